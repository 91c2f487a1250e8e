"""Weight loading: HF safetensors checkpoints (single or sharded) and dummy weights.

HF names map onto Strata's fused parameters: q_proj/k_proj/v_proj become row slices of
qkv_proj, gate_proj/up_proj row slices of gate_up_proj. Where each piece lands, and which
slice a tensor-parallel rank reads, is the parameter's `Sharding` (engine/layers/parallel.py).
Every parameter must be filled exactly once; anything missing or unexpected is a ValueError
naming the tensors.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from engine.layers.moe import expert_range, experts_of
from engine.layers.parallel import Piece, Sharding, _shard, sharding_of
from engine.layers.quant import ROW_SCALE
from engine.layers.quant import dequantize as quant_dequantize
from models.config import ModelConfig

LOAD_FORMATS = ("auto", "safetensors", "dummy")
# (HF sub-name, fused sub-name, shard) for projections stored separately in HF checkpoints
_FUSED = (
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", "gate"),
    (".up_proj.", ".gate_up_proj.", "up"),
)
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)  # recomputed, stored by some old checkpoints


def map_name(hf_name: str) -> tuple[str, str | ExpertShard | None]:
    """HF tensor name -> (Strata parameter name, shard or None when stored whole)."""
    expert = map_expert_name(hf_name)
    if expert is not None:
        return expert
    for hf_part, fused_part, shard in _FUSED:
        if hf_part in hf_name:
            return hf_name.replace(hf_part, fused_part), shard
    return hf_name, None


# ---- MoE experts: HF stores one tensor per expert, Strata one stack per layer (engine/layers/moe.py)
# `.weight_scale`: a quantized expert's scale (fp8's `weight_scale_inv` arrives renamed, _scale_alias);
# `.weight_scale_2`: NVFP4's per-tensor global scale (the stack's row scale `w13_scale_2` / `w2_scale_2`)
_EXPERT_NAME = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight(_scale(?:_2)?)?$")
_EXPERT_PARTS = {"gate_proj": ("w13", "gate"), "up_proj": ("w13", "up"), "down_proj": ("w2", None)}


@dataclass(frozen=True)
class ExpertShard:
    """Which row of an expert stack (dim 0) a per-expert checkpoint tensor fills, and its fused
    piece there (gate / up of w13; None for w2)."""

    expert: int
    piece: str | None


def checkpoint_name(name: str, shard: str | ExpertShard | None, cfg: ModelConfig) -> str:
    """The checkpoint's name of a parameter piece (map_name and _scale_alias undone): what a
    missing-tensor error names, since that is what the user can look for in the files."""
    if isinstance(shard, ExpertShard):
        stack, _, kind = name.rpartition(".")
        param, suffix = kind.split("_", 1) if "_" in kind else (kind, "")
        proj = {("w13", "gate"): "gate_proj", ("w13", "up"): "up_proj", ("w2", None): "down_proj"}[(param, shard.piece)]
        name = f"{stack}.{shard.expert}.{proj}.weight{'_' + suffix if suffix else ''}"
    else:
        name = next((name.replace(fused, part) for part, fused, s in _FUSED if s == shard and fused in name), name)
    if cfg.quant is not None and cfg.quant.checkpoint_scale == "weight_scale_inv" and name.endswith(".weight_scale"):
        name += "_inv"
    return name


def map_expert_name(hf_name: str) -> tuple[str, ExpertShard] | None:
    """`...mlp.experts.{e}.gate_proj.weight` -> (`...mlp.experts.w13`, ExpertShard(e, "gate")), or None
    (`.weight_scale` / `.weight_scale_2` -> the stack's `w13_scale` / `w13_scale_2`, engine/layers/moe_quant.py)."""
    m = _EXPERT_NAME.match(hf_name)
    if m is None:
        return None
    param, piece = _EXPERT_PARTS[m.group(3)]
    return f"{m.group(1)}.{param}{m.group(4) or ''}", ExpertShard(int(m.group(2)), piece)


def is_nextn_layer(hf_name: str, cfg: ModelConfig) -> bool:
    """A tensor of the multi-token-prediction layers GLM-4.5 and DeepSeek-V3 checkpoints store
    after the last decoder layer (`model.layers.{num_hidden_layers + i}`): not part of the model
    we serve (transformers skips them too)."""
    m = re.match(r"^model\.layers\.(\d+)\.", hf_name)
    return (cfg.moe is not None or cfg.mla is not None) and m is not None and int(m.group(1)) >= cfg.num_layers


def expert_pieces(p: nn.Parameter) -> list[str | ExpertShard | None]:
    """What a stack needs from the checkpoint: every piece of each expert it holds (an
    expert-parallel rank's experts only)."""
    sh = sharding_of(p)
    pieces = list(sh.pieces) if sh is not None else [None]
    first, _ = expert_range(p)
    return [ExpertShard(first + e, piece) for e in range(experts_of(p)) for piece in pieces]


def _copy_expert(param: nn.Parameter, handle: Any, src: str, shard: ExpertShard) -> None:
    """Copy checkpoint tensor `src` (one expert) into row `shard.expert` of an expert stack: that
    row is a 2-D parameter of its own, sharded like the stack minus the expert dim."""
    first, total = expert_range(param)
    if not 0 <= shard.expert < total:
        raise ValueError(f"tensor {src}: expert {shard.expert} outside the {total} experts")
    if not first <= shard.expert < first + experts_of(param):
        return  # another expert-parallel rank's expert
    row = param.data[shard.expert - first]
    sh = sharding_of(param)
    if sh is not None:
        _shard(row, Sharding(sh.dim - 1, sh.full_shape[1:], sh.pieces))  # type: ignore[arg-type]
    if getattr(param, ROW_SCALE, False):  # a per-row scale: a per-tensor scalar fills its piece's rows
        setattr(row, ROW_SCALE, True)
    _copy_into(row, handle, src, shard.piece)  # type: ignore[arg-type]


def checkpoint_files(path: Path) -> list[Path]:
    """Safetensors files of a checkpoint dir: from the index if there is one, else all *.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not weight_map:
            raise ValueError(f"{index} has no weight_map")
        files = [path / f for f in sorted(set(weight_map.values()))]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no safetensors weights in {path} (want model.safetensors or an index)")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ValueError(f"checkpoint {path} lacks shard files {missing}")
    return files


def _iter_handles(files: list[Path], progress: bool) -> Iterator[tuple[str, Any]]:
    """(tensor name, open safetensors handle): the caller reads only what it needs (get_slice)."""
    total = 0
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            total += len(h.keys())
    bar = tqdm(total=total, desc="loading weights", unit="tensor", disable=not progress)
    with bar:
        for f in files:
            with safe_open(str(f), framework="pt") as h:
                for name in h.keys():
                    yield name, h
                    bar.update(1)


def load_safetensors(model: nn.Module, cfg: ModelConfig, path: str | Path, progress: bool = True,
                     keep: Callable[[str], bool] | None = None) -> None:
    """Fill every parameter of `model` from the checkpoint in `path` (converting dtype/device).
    `keep`: read just the tensors whose names it accepts (a speculative head's, or the MTP layer
    of models/nextn.py, named as in the checkpoint); without it the MTP layers are skipped.

    A tensor-parallel rank reads only its slice of each sharded tensor (safetensors get_slice:
    no full copy in host memory). Raises ValueError for a quantized checkpoint, a shape
    mismatch, an unexpected tensor, or a parameter (or fused shard) the checkpoint does not
    provide.
    """
    params = dict(model.named_parameters())
    pending = {(n, s) for n, p in params.items() for s in _pieces_of(p)}
    stash: dict[str, dict[str, torch.Tensor]] = {}  # fp8 tensors of parameters kept plain
    unexpected: list[str] = []
    for hf_name, handle in _iter_handles(checkpoint_files(Path(path)), progress):
        if hf_name.endswith(_IGNORED_SUFFIXES) or (hf_name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue  # tied checkpoints sometimes store a copy of the embedding; we read the embedding
        if (not keep(hf_name)) if keep is not None else is_nextn_layer(hf_name, cfg):
            continue
        if cfg.quant is not None and hf_name.endswith(_UNUSED_QUANT_SUFFIXES):
            continue  # activation and KV-cache scales: see models/quant.py
        name, shard = map_name(_scale_alias(hf_name, cfg))
        if cfg.quant is not None and shard is None and _stash_kept_plain(name, params, handle, hf_name, stash):
            continue
        if name not in params:
            unexpected.append(hf_name)
            continue
        _copy_into(params[name], handle, hf_name, shard)
        if shard is None:  # a whole (already fused) tensor fills every piece
            pending -= {(name, s) for s in _pieces_of(params[name])}
        pending.discard((name, shard))
    for name in _fill_kept_plain(params, stash, path):
        pending -= {(name, s) for s in _pieces_of(params[name])}
    if unexpected:
        hint = ""
        if any(n.endswith(".weight_scale_inv") for n in unexpected):  # block scales the config does not declare
            hint = (" (weight_scale_inv are block-fp8 scales: the config's quantization_config needs "
                    "quant_method fp8 with weight_block_size, e.g. [128, 128])")
        raise ValueError(f"checkpoint {path} has {len(unexpected)} unexpected tensors: {_head(unexpected)}{hint}")
    if pending:
        missing = sorted(checkpoint_name(n, s, cfg) for n, s in pending)
        raise ValueError(f"checkpoint {path} lacks {len(missing)} tensor(s): {_head(missing)}")


def _pieces_of(p: nn.Parameter) -> list[str | ExpertShard | None]:
    sh = sharding_of(p)
    if experts_of(p):
        return expert_pieces(p)
    return [None] if sh is None else list(sh.pieces)


def _copy_into(param: nn.Parameter, handle: Any, src: str, shard: str | ExpertShard | None) -> None:
    """Copy this rank's part of checkpoint tensor `src` into `param` (fused shard `shard`)."""
    if isinstance(shard, ExpertShard):
        return _copy_expert(param, handle, src, shard)
    if getattr(param, ROW_SCALE, False):
        return _copy_row_scale(param, handle, src, shard)
    sh = sharding_of(param)
    sl = handle.get_slice(src)
    _check_stored_dtype(param, sl.get_dtype(), src)
    shape = tuple(sl.get_shape())
    if sh is None:  # replicated: the whole tensor
        if shape != tuple(param.shape):
            raise ValueError(f"tensor {src} has shape {shape}, expected {tuple(param.shape)}")
        param.data.copy_(handle.get_tensor(src))
        return
    if shard is None and None not in sh.pieces:  # a checkpoint storing the fused tensor whole
        pieces = [Piece((p.full_offset + p.src[0], p.full_offset + p.src[1]), p.dst, sh.full_shape[sh.dim], 0)
                  for p in sh.pieces.values()]
    elif shard in sh.pieces:
        pieces = [sh.pieces[shard]]
    else:
        raise ValueError(f"tensor {src}: parameter has no shard {shard!r}")
    for piece in pieces:
        want = list(param.shape)
        want[sh.dim] = piece.full_len
        if shape != tuple(want):
            raise ValueError(f"tensor {src} has shape {shape}, expected {tuple(want)}")
        a, b = piece.src
        part = sl[a:b] if sh.dim == 0 else sl[:, a:b]  # only these bytes are read from the file
        param.data.narrow(sh.dim, piece.dst, b - a).copy_(part)


# ---- quantized checkpoints (models/quant.py, engine/layers/quant.py)
# activation scales (the engine quantizes activations per token) and KV-cache scales (its fp8
# KV cache is unscaled) are read past; every weight and weight scale must be there
_UNUSED_QUANT_SUFFIXES = (".input_scale", ".k_scale", ".v_scale", ".kv_scale")
_STORED = {torch.float8_e4m3fn: "F8_E4M3", torch.uint8: "U8"}  # quantized parameter -> safetensors dtype


def _scale_alias(hf_name: str, cfg: ModelConfig) -> str:
    """fp8-block checkpoints name the multiplier `weight_scale_inv`: the engine's `weight_scale`."""
    inv = ".weight_scale_inv"
    if cfg.quant is not None and cfg.quant.checkpoint_scale == "weight_scale_inv" and hf_name.endswith(inv):
        return hf_name[: -len(inv)] + ".weight_scale"
    return hf_name


def _check_stored_dtype(param: nn.Parameter, stored: str, src: str) -> None:
    """A quantized parameter takes only its own bits: a bf16 tensor where e4m3 is expected means
    the config's quantization does not describe this tensor (casting would drop its scale). An
    integer tensor never casts to a float weight (it would load as numbers of the wrong scale)."""
    want = _STORED.get(param.dtype)
    if want is None and param.dtype.is_floating_point and stored[0] in "IUB":  # I8..I64, U8..U64, BOOL
        raise ValueError(f"tensor {src} is stored as {stored}, an integer type, where the model expects float "
                         "weights (an integer-quantized checkpoint whose quantization config is missing or not "
                         "supported?)")
    if want is not None and stored != want:
        raise ValueError(f"tensor {src} is stored as {stored}, but the checkpoint's quantization config makes it "
                         f"{want} (is the module missing from the config's ignore list?)")


def _copy_row_scale(param: nn.Parameter, handle: Any, src: str, shard: str | None) -> None:
    """A per-row scale (engine/layers/quant.py ROW_SCALE) from a checkpoint's scalar (per tensor),
    [n] or [n, 1] (per channel) scale: a scalar fills its tensor's rows."""
    t = handle.get_tensor(src).float().reshape(-1)
    sh = sharding_of(param)
    whole = Piece((0, param.shape[0]), 0, param.shape[0], 0)
    if sh is None:
        pieces = [whole]
    elif shard in sh.pieces:
        pieces = [sh.pieces[shard]]
    elif shard is None and t.numel() == sh.full_shape[0]:  # one scale tensor for a fused weight stored whole
        pieces = [Piece((p.full_offset + p.src[0], p.full_offset + p.src[1]), p.dst, sh.full_shape[0], 0)
                  for p in sh.pieces.values()]
    else:
        raise ValueError(f"tensor {src}: cannot place a scale of {t.numel()} values in {tuple(param.shape)}")
    for piece in pieces:
        full = t.expand(piece.full_len) if t.numel() == 1 else t
        if full.numel() != piece.full_len:
            raise ValueError(f"scale {src} has {t.numel()} values, expected 1 or {piece.full_len}")
        a, b = piece.src
        param.data[piece.dst : piece.dst + b - a].copy_(full[a:b])


def _stash_kept_plain(name: str, params: dict[str, nn.Parameter], handle: Any, src: str,
                      stash: dict[str, dict[str, torch.Tensor]]) -> bool:
    """Whether `src` is the e4m3 weight, or its scale, of a parameter the engine keeps plain
    (one it uses only as matrices, not a quantized Linear: MLA's kv_b_proj, which DeepSeek's fp8
    checkpoints store in e4m3 with block scales). Such pairs are read whole and dequantized
    once both are in (`_fill_kept_plain`), on every device."""
    if name.endswith(".weight_scale"):
        weight = name[: -len("_scale")]
        if name in params or weight not in params or params[weight].dtype in _STORED:
            return False
        stash.setdefault(weight, {})["scale"] = handle.get_tensor(src)
        return True
    p = params.get(name)
    if (p is None or p.dtype in _STORED or p.dim() != 2 or name + "_scale" in params
            or handle.get_slice(src).get_dtype() != _STORED[torch.float8_e4m3fn]):
        return False
    stash.setdefault(name, {})["q"] = handle.get_tensor(src)
    return True


def _fill_kept_plain(params: dict[str, nn.Parameter], stash: dict[str, dict[str, torch.Tensor]],
                     path: str | Path) -> list[str]:
    """Dequantize each stashed (e4m3, scale) pair as engine/layers/quant.py's to_plain would
    (per tensor, per row or 128x128 blocks, by the scale's shape) and fill this rank's part."""
    for name, parts in stash.items():
        if set(parts) != {"q", "scale"}:
            raise ValueError(f"checkpoint {path}: {name} has {'a scale' if 'scale' in parts else 'e4m3 values'} "
                             "but not the other (an fp8 weight needs both)")
        q, s = parts["q"], parts["scale"].float()
        n = q.shape[0]
        fmt = "fp8_row" if s.numel() in (1, n) else "fp8_block"
        s = s.reshape(-1).expand(n) if fmt == "fp8_row" else s
        full = quant_dequantize(SimpleNamespace(quant=fmt, weight=q, weight_scale=s))
        p, sh = params[name], sharding_of(params[name])
        if sh is None:
            if tuple(full.shape) != tuple(p.shape):
                raise ValueError(f"tensor {name} has shape {tuple(full.shape)}, expected {tuple(p.shape)}")
            p.data.copy_(full)
            continue
        for piece in sh.pieces.values():
            a, b = piece.src
            p.data.narrow(sh.dim, piece.dst, b - a).copy_(full.narrow(sh.dim, piece.full_offset + a, b - a))
    return list(stash)


def _head(names: list[str], n: int = 8) -> str:
    more = f" ... (+{len(names) - n} more)" if len(names) > n else ""
    return ", ".join(names[:n]) + more


DUMMY_DRAW_ELEMS = 1 << 28  # a dummy draw's float32 chunk: at most 1 GiB (DeepSeek-V3's w13 stack is 30 GB)


def init_dummy(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Deterministic random weights: N(0, std) for matrices, 1 for norms, 0 for biases.

    Each parameter draws its whole, unsharded tensor from its own generator seeded by
    (seed, parameter index) on the parameter's device, and a tensor-parallel rank keeps its
    slice of it: the same shards a real checkpoint would give, so tp=N runs the same model as
    tp=1 (the parameter names, hence the indices, do not depend on the rank). Results depend
    only on the seed, the config and the device type. A tensor of more than DUMMY_DRAW_ELEMS
    elements is drawn in chunks of rows (dim 0), in order, so the float32 draw never holds more
    than one chunk: a model that fits the device in bf16 loads there.
    """
    for i, (name, p) in enumerate(sorted(model.named_parameters())):
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
        elif name.endswith(".bias"):
            p.data.zero_()
        else:
            sh = sharding_of(p)
            full = tuple(p.shape) if sh is None else sh.full_shape
            gen = torch.Generator(device=p.device).manual_seed(seed * 1_000_003 + i)
            fill_from_rows(p, full, _dummy_rows(full, std, gen, p.device))


def _dummy_rows(full: tuple[int, ...], std: float, gen: torch.Generator,
                device: torch.device) -> Iterator[tuple[int, torch.Tensor]]:
    """N(0, std) draws of a tensor of shape `full` as (first row, rows) chunks: one chunk when it is
    small. Drawn in float32 then cast by the copy, so bf16 and fp32 dummy models share one distribution."""
    n = math.prod(full)
    if not full or n <= DUMMY_DRAW_ELEMS:
        yield 0, torch.empty(full, dtype=torch.float32, device=device).normal_(0.0, std, generator=gen)
        return
    step = max(1, DUMMY_DRAW_ELEMS // (n // full[0]))
    for r0 in range(0, full[0], step):
        rows = torch.empty((min(step, full[0] - r0), *full[1:]), dtype=torch.float32, device=device)
        yield r0, rows.normal_(0.0, std, generator=gen)


def fill_from_rows(p: nn.Parameter, full: tuple[int, ...], chunks: Iterator[tuple[int, torch.Tensor]]) -> None:
    """Copy parameter p's share of a tensor of shape `full` given as (first row, rows) chunks along
    dim 0: an expert-parallel rank keeps its experts' rows, a tensor-parallel rank its pieces."""
    sh = sharding_of(p)
    first, total = expert_range(p)
    for r0, buf in chunks:
        if experts_of(p) != total:  # an expert-parallel rank keeps its experts of the whole draw
            lo, hi = max(r0, first), min(r0 + buf.shape[0], first + experts_of(p))
            if lo >= hi:
                continue
            buf, r0 = buf[lo - r0 : hi - r0], lo - first
        if full == tuple(p.shape):  # tp 1 (or a replicated tensor): the whole draw
            (p.data if buf.dim() == 0 else p.data[r0 : r0 + buf.shape[0]]).copy_(buf)
            continue
        for piece in sh.pieces.values():
            a, b = piece.src
            src = piece.full_offset + a
            if sh.dim != 0:
                p.data[r0 : r0 + buf.shape[0]].narrow(sh.dim, piece.dst, b - a).copy_(buf.narrow(sh.dim, src, b - a))
                continue
            lo, hi = max(src, r0), min(src + b - a, r0 + buf.shape[0])
            if lo < hi:
                p.data.narrow(0, piece.dst + lo - src, hi - lo).copy_(buf[lo - r0 : hi - r0])


WEIGHT_SAMPLES = 8  # 64-byte pieces of each tensor's data in weights_identity


def weights_identity(path: str | Path, load_format: str = "auto", seed: int = 0) -> bytes:
    """Bytes that change when the weights do (the L3 fingerprint, engine/cache/l3.py): for dummy
    weights "dummy" and the seed; for a checkpoint each safetensors file's name, size and header
    (tensor names, shapes, dtypes, offsets), and WEIGHT_SAMPLES evenly spaced 64-byte pieces of
    every tensor's data. The header alone is the same for two checkpoints of one architecture (a
    fine-tune, an edited tensor), whose KV differs; reading every byte would cost a start seconds
    a GB, where the samples are ~0.5 KB a tensor (a fine-tune moves them all; an edit that misses
    every sample goes unseen)."""
    if load_format == "dummy":
        return b"dummy:%d" % seed
    parts = []
    for f in checkpoint_files(Path(path)):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = fh.read(min(n, 100 << 20))
            samples = hashlib.sha256()
            for entry in json.loads(header).values():
                if "data_offsets" in entry:  # (not "__metadata__")
                    lo, hi = entry["data_offsets"]
                    for at in sorted({max(hi - lo - 64, 0) * k // (WEIGHT_SAMPLES - 1) for k in range(WEIGHT_SAMPLES)}):
                        fh.seek(8 + n + lo + at)
                        samples.update(fh.read(min(64, hi - lo)))
        parts.append(b"%s\0%d\0" % (f.name.encode(), f.stat().st_size) + header + samples.digest())
    return b"\0\0".join(parts)
