"""Assembling a rank's ModelRunner: what is built once, before the first step.

`assemble` loads the model, sizes the KV pool and binds the attention backend (the parts a
runner executes steps on: `Assembled`); `make_ready` runs once the runner exists: every kernel
warmed, CUDA graphs captured, the grammar helpers started, so that nothing a request can reach
compiles or captures after the worker says Ready. Step execution is engine/run/runner.py.
"""

from __future__ import annotations

import ctypes
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
import torch

from engine.config import ServerConfig
from engine.layers import batch_invariant, cpu_attention, triton_ops
from engine.layers.attention import AttentionBackend, create_backend
from engine.layers.cp_attention import context_parallel
from engine.layers.flashinfer_attention import set_decode_kernel
from engine.layers.kv_layout import KVLayout
from engine.layers.kv_pool import KVPool
from engine.layers.mla_attention import MLABackend, decode_kernel_available
from engine.layers.parallel import pack_for_cpu
from engine.run import TORCH_PREIMPORTED
from engine.run.dist import init_distributed, rank_config
from engine.run.eagle import HeadDraft, make_head_draft
from engine.run.memory import OutOfMemory, check_weights_fit, kv_bytes_per_token, plan_pool
from engine.run.spec import DraftModel, SelfDraft, Speculator
from engine.run.warmup import warm_up
from models.config import ModelConfig
from models.llama import fold_norms
from models.registry import kv_layout, load_model

if TYPE_CHECKING:
    from engine.run.runner import ModelRunner

log = structlog.get_logger()


@dataclass
class Assembled:
    """A rank's loaded model, its KV pool and bound attention backend."""

    device: torch.device
    dtype: torch.dtype
    deterministic: bool
    model: torch.nn.Module
    mcfg: ModelConfig
    shard: ModelConfig  # this rank's heads and MLP slice: what its KV pool holds
    kv_layout: KVLayout  # what a token caches per layer, as the model declares it
    kv_dtype: torch.dtype
    kv: KVPool
    backend: AttentionBackend
    num_pages: int
    max_context: int
    startup: dict[str, float] = field(default_factory=dict)  # seconds by phase, for the ready line


def assemble(cfg: ServerConfig, rank: int) -> Assembled:
    """Load, size, bind: the device (joining the tp group at tp > 1), the model, the KV pool the
    model's declared layout needs, and the attention backend bound to it."""
    device = init_distributed(cfg, rank)  # tp > 1: joins the group; cuda:LOCAL_RANK on GPU
    # deterministic inference (engine/layers/batch_invariant.py; the CPU's default): fixed-shape
    # GEMMs and the torch backend's invariant attention (on a CPU cpu_attention's kernel; on CUDA
    # decode captured in CUDA graphs where the invariant kernel runs: attention.py); the fused
    # norm/RoPE/SiLU kernels stay (one program per row: invariant), the GEMVs go
    deterministic = cfg.deterministic(device.type)
    dtype = resolve_dtype(cfg.dtype, device, deterministic)
    batch_invariant.enable(deterministic, device.type)
    if device.type == "cuda":
        # the forward (and the replays of its graphs) runs on a high-priority stream, so
        # that the host tier's backups, on a default-priority side stream, get only the
        # SMs the forward leaves idle (on one stream priority each, the write-through's
        # gathers slowed prefill-heavy steps by ~25% on the H200)
        torch.cuda.set_stream(torch.cuda.Stream(device, priority=-1))
    if device.type == "cpu":
        torch.set_num_threads(cpu_threads(cfg.cpu_threads))
        keep_freed_memory()
        if TORCH_PREIMPORTED:  # in-process users (tests, LocalEngine) keep torch's spinning default
            log.debug("torch was imported before engine.run: OMP_WAIT_POLICY left as torch found it")
    kv_dtype = resolve_kv_dtype(cfg.kv_cache_dtype, dtype)
    if cfg.cp_size > 1 and cfg.model:  # before the weights load: a refusal should not take minutes
        check_context_parallel(cfg.cp_size, kv_layout(ModelConfig.from_dir(cfg.model)), deterministic, device,
                               kv_dtype)
    t0 = time.perf_counter()
    model, mcfg = load_checked(cfg, dtype, device)
    startup = {"load_s": time.perf_counter() - t0}
    shard = rank_config(mcfg)
    layout = kv_layout(shard)
    pool = plan_pool(cfg, shard, kv_dtype, device, dtype)
    kv_gib = pool.num_pages * cfg.page_size * kv_bytes_per_token(shard, kv_dtype) / 2**30
    log.info(
        f"kv pool: {(pool.num_pages - 1) * cfg.page_size} tokens, {kv_gib:.2f} GiB on {device}",
        sized_by=pool.sized_by, layout=layout.describe(kv_dtype),
        threads=torch.get_num_threads() if device.type == "cpu" else None,
    )
    if pool.context_capped:  # a prompt past it is a 400 naming the context: say why it is not the model's
        log.warning(f"context capped to {pool.max_context} tokens: the KV pool holds no more for one request",
                    wanted=pool.wanted_context, hint="a larger pool (--max-total-tokens, --mem-fraction)")
    kv = KVPool.from_layout(layout, mcfg.num_layers, pool.num_pages, cfg.page_size, kv_dtype, device)
    if not layout.is_gqa and decode_kernel_available(device) and cfg.cp_size == 1:
        # MLA on CUDA: the model attends its latent pool itself (triton decode kernel; under
        # deterministic inference every row through it); the backend holds the static page table
        # its decode CUDA graphs read (not under cp: no graphs, the cp backend replaces it)
        backend: AttentionBackend = MLABackend(device)
    else:
        backend = create_backend(backend_name(cfg, deterministic, layout, dtype), device)
    set_decode_kernel(backend, cfg.decode_kernel)  # --decode-kernel; auto: the GPU's tuning file
    if cfg.cp_size > 1:  # the pages of a request round robin over the cp ranks (cp_attention.py)
        # the cp backend replaces this one (its flashinfer workspace reused), so only the cp backend is
        # bound; an MLA model attends its latents itself under cp too (engine/layers/mla_cp.py), eagerly
        backend = context_parallel(backend)
    backend.bind(
        num_q_heads=shard.num_heads,
        kv_pool=kv,
        max_batch=cfg.decode_graph_rows,  # a decode graph's rows (verify rows replay them too)
        max_pages_per_req=math.ceil(pool.max_context / cfg.page_size) + 1,
        q_dtype=dtype,
        fp8_math=cfg.attention_fp8_math,
    )
    return Assembled(device, dtype, deterministic, model, mcfg, shard, layout, kv_dtype, kv, backend,
                     pool.num_pages, pool.max_context, startup)


def check_context_parallel(cp_size: int, layout: KVLayout, deterministic: bool, device: torch.device,
                           kv_dtype: torch.dtype) -> None:
    """Refuse at start what context parallelism does not build under deterministic inference: MLA's
    invariant attention, and any but the CPU kernel's (every row a decode row of its own pages:
    cp_attention.plan_step's per_row)."""
    if cp_size <= 1 or not deterministic:
        return
    if not layout.is_gqa:
        raise ValueError(f"--cp-size {cp_size} with --enable-deterministic-inference: MLA's batch-invariant "
                         "attention under context parallelism is not built")
    if device.type != "cpu" or not cpu_attention.fits(kv_dtype, layout.components[0].dim):
        raise ValueError(f"--cp-size {cp_size} with --enable-deterministic-inference: its invariant attention is "
                         "built on the CPU attention kernel only (a CPU, float32 or bf16 KV, the kernel compiled)")


def backend_name(cfg: ServerConfig, deterministic: bool, layout: KVLayout, dtype: torch.dtype) -> str:
    """Deterministic inference has one attention path: the torch backend's (config.py refuses
    another named backend with the mode on). A model whose KV layout is not K and V (MLA's
    latent) attends its pool itself (engine/layers/mla_attention.py): the GQA kernels are not
    planned for it (the torch backend's per-step plan is cheap, and no CUDA graphs). flashinfer
    has no float32 kernels: --dtype float32 with the auto backend is torch on a GPU too (an
    explicit flashinfer is refused at start)."""
    if cfg.attention_backend == "flashinfer" and cfg.resolved_device != "cuda":  # the first thing to fix
        raise ValueError("--attention-backend flashinfer needs a CUDA device; use --attention-backend torch (or auto)")
    if deterministic or not layout.is_gqa:
        return "torch"
    if dtype == torch.float32 and cfg.attention_backend == "auto":
        return "torch"
    if dtype == torch.float32 and cfg.attention_backend == "flashinfer":
        raise ValueError("--attention-backend flashinfer: flashinfer has no float32 kernels; use --dtype bfloat16 "
                         "(or float16), or --attention-backend torch (or auto) for float32")
    return cfg.attention_backend


def make_speculator(cfg: ServerConfig, a: Assembled) -> Speculator | None:
    """Speculative decoding's part on this rank (engine/run/spec.py), when it is on."""
    if not cfg.speculative_algorithm:
        return None
    layers, path = cfg.speculative_draft_layers, cfg.speculative_draft_model_path
    draft: SelfDraft | DraftModel | HeadDraft | None = None
    if cfg.speculative_algorithm in ("EAGLE", "EAGLE3", "NEXTN"):  # a head fed the target's hidden states
        draft = make_head_draft(cfg, a.model, a.mcfg, a.num_pages, a.max_context, a.dtype, a.kv_dtype, a.device)
    elif layers:
        draft = SelfDraft(a.model, layers, a.kv, a.backend)
    elif path:
        draft = DraftModel(path, a.mcfg.vocab_size, a.num_pages, cfg.page_size, cfg.decode_graph_rows,
                           math.ceil(a.max_context / cfg.page_size) + 1, a.dtype, a.device,
                           lambda layout: backend_name(cfg, a.deterministic, layout, a.dtype), cfg.load_format)
    log.info("speculative decoding", algorithm=cfg.speculative_algorithm,
             steps=cfg.speculative_num_steps, draft_layers=layers or None, draft_model=path or None)
    trees = cfg.speculative_eagle_topk > 1
    if trees and not a.backend.takes_tree_masks:  # torch, flashinfer and MLA's backends take them
        raise ValueError(f"--speculative-eagle-topk {cfg.speculative_eagle_topk}: draft trees need an attention "
                         f"backend that takes tree masks (torch, flashinfer, MLA), not {type(a.backend).__name__}")
    return Speculator(draft, cfg.page_size, a.device, trees)


def make_ready(runner: ModelRunner) -> None:
    """Warm up, capture, start the grammar helpers: after this nothing a step can reach compiles."""
    from engine.run.expert_counts import ExpertCounts

    runner.startup["warmup_s"] = warm_up(runner)  # every kernel compiled before Ready
    if runner.device.type == "cuda":
        triton_ops.warm_to_host(runner.device)  # the results' store kernel (runner's _to_host)
    t0 = time.perf_counter()
    runner.graphs = capture_graphs(runner)
    runner.expert_counts = ExpertCounts(runner.model)  # MoE layers' routed tokens (zeroed: after warm-up)
    if runner.device.type == "cuda":  # load the future-reference kernels now, not in a served step
        runner.resolve_ids([-1], [0], [1])
        if runner.graphs is not None:
            runner.graphs.warm_future_refs(runner.last_token)
        torch.cuda.synchronize(runner.device)
    runner.startup["capture_s"] = time.perf_counter() - t0
    runner.grammar.wait_ready()  # the grammar helper processes, started with GrammarSlots
    log.info(
        "runner ready", **{k: round(v, 2) for k, v in runner.startup.items()},
        pages=runner.num_pages, max_context=runner.max_context, dtype=str(runner.dtype),
        backend=type(runner.backend).__name__, cuda_graphs=runner.graphs is not None,
        deterministic=runner.deterministic,
    )


def capture_graphs(runner: ModelRunner):  # noqa: ANN201
    """CUDA graphs for decode, unless disabled, on CPU, or the backend or model cannot be captured."""
    cfg = runner.cfg
    if runner.device.type != "cuda" or cfg.disable_cuda_graph:
        return None
    if not runner.backend.supports_cuda_graph:
        log.info("cuda graphs off", reason=f"{type(runner.backend).__name__} is not capturable")
        return None
    blocker = cuda_graph_blocker(runner.model)
    if blocker is not None:
        log.info("cuda graphs off", reason=blocker)
        return None
    from engine.run.cuda_graph import CudaGraphRunner

    # a draft head's hidden-state tap: the replayed graph hands out what its hooks computed at capture
    tap = getattr(runner.spec.draft, "tap", None) if runner.spec is not None else None
    graphs = CudaGraphRunner(runner.model, runner.kv, runner.backend, cfg.decode_graph_rows, runner.device,
                             outputs_of=tap)
    try:
        with torch.inference_mode():
            graphs.capture()
            capture_draft(runner)
    except torch.OutOfMemoryError as e:
        raise OutOfMemory(
            f"out of GPU memory while capturing CUDA graphs ({e}); lower --mem-fraction or "
            "--max-running-requests, or pass --disable-cuda-graph"
        ) from e
    return graphs


def capture_draft(runner: ModelRunner) -> None:
    """A draft's own decode graphs (a head's, engine/run/eagle.py: HeadDraft.capture; a separate
    draft model's, engine/run/spec.py: DraftModel.capture), where its backend and its layers can
    be captured: its draft steps and the rows it follows replay them."""
    draft = runner.spec.draft if runner.spec is not None else None
    capture = getattr(draft, "capture", None)
    backend = getattr(draft, "backend", None)
    if capture is None or backend is None or not backend.supports_cuda_graph:
        return
    blocker = cuda_graph_blocker(draft.head if isinstance(draft, HeadDraft) else draft.model)  # type: ignore[union-attr]
    if blocker is not None:
        log.info("draft cuda graphs off", reason=blocker)
        return
    capture(runner.cfg.decode_graph_rows)


def resolve_kv_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    return torch.float8_e4m3fn if name == "fp8_e4m3" else model_dtype


def cpu_has_bf16() -> bool:
    """Native bf16 arithmetic on this CPU (AVX512-BF16 or AMX; the Linux flags)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(f" {flag}" in text for flag in ("avx512_bf16", "amx_bf16"))


def resolve_dtype(name: str, device: torch.device, deterministic: bool = False) -> torch.dtype:
    """--dtype auto: bfloat16 on a GPU; on a CPU bfloat16 where it has native bf16 arithmetic and
    the engine is deterministic (its default there), else float32. Deterministic bf16 is 1.5-1.8x
    deterministic float32's throughput on 2 cores with AMX (16 x 64/128: 300-305 vs 179-198 tok/s;
    32 x 128/64: 365-367 vs 206-218; docs/PERF.md, f65bf6d); without determinism bf16's answers move
    with the batch and the cache (the README's question answered two ways, fresh and cached),
    float32's texts agree (docs/architecture.md, "Deterministic inference")."""
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if deterministic and cpu_has_bf16() else torch.float32
    return getattr(torch, name)


def cuda_graph_blocker(model: torch.nn.Module) -> str | None:
    """Why `model`'s decode cannot be captured in a CUDA graph (None: it can). The model's own
    `supports_cuda_graph` decides where it declares one (MoeForCausalLM: False with MoE layers);
    otherwise a submodule declaring it False does (engine/layers/moe.py's MoE on its torch path,
    which reads per-expert counts on the host: on the CPU; on CUDA it takes the fused kernels,
    capturable, under deterministic inference too), so a model that does not declare it (DeepSeek-V3) is
    still served, uncaptured, instead of failing in capture."""
    flag = getattr(model, "supports_cuda_graph", None)
    if flag is not None:
        return None if flag else f"{type(model).__name__}.supports_cuda_graph is False"
    for m in model.modules():
        if getattr(m, "supports_cuda_graph", True) is False:  # the instance's: MoE's depends on its path
            return f"{type(m).__name__} layers are not capturable (torch path)"
    return None


def cpu_threads(requested: int) -> int:
    """--cpu-threads: torch intra-op threads of a CPU worker; 0 = every core this process may run on.

    All of them, not one fewer: the forward is the work, and the scheduler and tokenizer
    processes mostly wait on their sockets while it runs (measured on 2 cores: one thread
    gave 0.86x transformers' throughput). The affinity mask, not os.cpu_count(), so taskset and
    cgroup cpusets are honoured."""
    return requested if requested > 0 else len(os.sched_getaffinity(0))


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
HEAP_KEEP_BYTES = 1 << 30  # freed heap memory kept for reuse, up to this much at its top


def keep_freed_memory() -> bool:
    """A CPU worker's large tensors from malloc's heap, and their memory kept when freed: glibc
    serves an allocation of more than 32 MiB (its dynamic threshold's ceiling) by a fresh mmap and
    returns it, and trims the heap's free top, so every step's activations were first-touched
    again, a page fault a 4 KiB page (a 16 x 128-token bf16 prefill spent ~30% of its 850 ms in
    them: 595 ms kept). The worker's memory stays at its peak step's instead of falling back
    between steps. Whether glibc took both settings (no-op without glibc)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, 1 << 28) and mallopt(_M_TRIM_THRESHOLD, HEAP_KEEP_BYTES))


def load_checked(cfg: ServerConfig, dtype: torch.dtype, device: torch.device):  # noqa: ANN201
    """load_model with a clear error when the weights cannot fit the device, or when --ep-size
    asks for expert parallelism of a model without experts."""
    if cfg.ep_size > 1 and cfg.model:
        ModelConfig.from_dir(cfg.model).check_ep_size(cfg.ep_size)
    check_weights_fit(cfg.model, dtype, device, cfg.tp_size, cfg.tp_size * cfg.cp_size // cfg.nnodes)
    try:
        model, mcfg = load_model(cfg.model, cfg.load_format, dtype, device, quantization=cfg.quantization or None)
    except torch.OutOfMemoryError as e:
        raise OutOfMemory(f"the model's weights do not fit on {device} in {dtype}: {e}") from e
    if device.type == "cpu":
        log.info("cpu projections in oneDNN's layout", layers=pack_for_cpu(model))
    elif fold_norms(model):  # deterministic inference where the GPU's tuning folds them (det_norm_fold_max_hidden)
        log.info("deterministic inference: the RMSNorms folded into the GEMMs", layers=mcfg.num_layers)
    return model, mcfg
