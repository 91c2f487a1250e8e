"""The model fingerprint a worker reports for the L3 disk tier (it knows the weights), and the
WorkerReady fields that carry it."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Any

import msgspec
import torch

from engine.cache.l3 import model_fingerprint
from engine.layers import cpu_kernels
from models.loader import weights_identity
from msgs.done import WorkerReady

REPO = Path(__file__).resolve().parents[2]
KERNEL_DIRS = ("engine/layers", "models")  # the code whose arithmetic writes a page


@functools.cache
def kernel_sources(root: Path = REPO) -> str:
    """A digest of the kernels' and models' source (.py, .c, .cu, .h under KERNEL_DIRS): a
    deterministic page's bits are a function of that code, which a release may change (a sum taken
    in a new order), so L3 pages survive a restart of the same code only."""
    h = hashlib.sha256()
    for d in KERNEL_DIRS:
        for f in sorted((root / d).rglob("*")):
            if f.suffix in (".py", ".c", ".cu", ".h") and f.is_file():
                h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def arithmetic_identity(deterministic: bool, device: torch.device, cp_size: int = 1, norm_folded: bool = False) -> str:
    """What decides a page's bits beyond the model: a deterministic engine's KV is a function of
    its kernels, which the device picks (a CPU's ISA and whether our C kernels built; a GPU's
    model, and whether its tuning folds the norms into the GEMMs: models/llama.py fold_norms), and
    of --cp-size (attention merged over cp ranks sums in another order: layer 1's K/V on differ),
    so it shares pages only with engines of the same; a non-deterministic engine's KV moves with
    its batches anyway, and it shares with any other such engine. Deterministic: the kernels'
    source too (kernel_sources)."""
    if not deterministic:
        return "nondeterministic"
    src = kernel_sources()
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        fold = "/normfold" if norm_folded else ""
        return f"deterministic/cuda/{torch.cuda.get_device_name(device)}/sm{major}{minor}/cp{cp_size}{fold}/src:{src}"
    cpu = hashlib.sha256(cpu_kernels.cpu_identity().encode()).hexdigest()[:16]
    return f"deterministic/{device.type}/{cpu}/c-kernels:{cpu_kernels.library() is not None}/cp{cp_size}/src:{src}"


def worker_fingerprint(
    cfg: Any, dtype: Any, kv_dtype: Any, page_bytes: int, num_layers: int, kv_layout: str = "", arithmetic: str = ""
) -> bytes:
    """config.json, the weights' identity (models/loader.py), dtypes and layout (the page's
    bytes and layers, and the model's declared KV layout: `KVLayout.describe`), and the
    arithmetic that wrote it (`arithmetic_identity`)."""
    config = Path(cfg.model, "config.json").read_bytes()
    weights = weights_identity(cfg.model, cfg.load_format) + b"\0quantization:" + cfg.quantization.encode()
    return model_fingerprint(config, weights, str(dtype), str(kv_dtype), cfg.page_size, cfg.tp_size,
                             page_bytes, num_layers, kv_layout + "\0" + arithmetic)


def l3_ready_fields(cfg: Any, runner: Any) -> dict[str, Any]:
    """What the scheduler needs of this rank for the disk tier: the page layout's layers and,
    with --l3-dir, the model fingerprint (the worker knows the weights)."""
    fields: dict[str, Any] = {"num_layers": runner.mcfg.num_layers,
                              "kv_components": len(runner.kv_layout.components)}
    if cfg.l3_dir and cfg.enable_hierarchical_cache:
        fields["l3_fingerprint"] = worker_fingerprint(
            cfg, runner.dtype, runner.kv_dtype, runner.host_tier.page_bytes, runner.mcfg.num_layers,
            runner.kv_layout.describe(runner.kv_dtype),
            arithmetic_identity(runner.deterministic, runner.device, cfg.cp_size,
                                getattr(runner.model, "norm_folded", False)),
        )
    return fields


class WithL3Identity:
    """The worker's `done` outbox, with the L3 fields filled into its WorkerReady."""

    def __init__(self, done: Any, fields: dict[str, Any]) -> None:
        self.done, self.fields = done, fields

    def send(self, msg: Any) -> None:
        if isinstance(msg, WorkerReady):
            msg = msgspec.structs.replace(msg, **self.fields)
        self.done.send(msg)
