"""Ready means warm: run every kernel the configured path will use once, before the worker
reports ready, so no request pays a compile (flashinfer's JIT, triton, torch.compile).

Covered: an eager prefill (a fresh prompt and one continuing after a cached page, so both
attention paths run) and an eager decode batch (and on a GPU a one-row decode), in the configured dtype, KV dtype and
attention math; the sampler's greedy, temperature, top-k/top-p/min-p, penalty and logprob
paths. Decode CUDA graphs are captured (and so run) separately, for every batch size.
On a GPU, every projection's GEMM also runs at a ladder of row counts up to the largest
step (`warm_gemms`): cuBLAS picks its kernel by shape, and CUDA loads a kernel on its first
launch (lazy loading), a load that waits for all the work queued on the device, the host
tier's backups on the side stream included: a served prefill step stalled 23-43 ms on
such loads, 8 of them in 40 steps (H200 profile, STRATA_PROFILE_STEPS). Under deterministic
inference the projections are one triton GEMM (engine/layers/invariant_gemm.py), compiled
once per tile choice: warmed at the first row count of each (decode, mid, prefill).
The KV written here lands in free pages: every page is written by its request's prefill
before anything reads it, so the garbage is never seen.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from tqdm import tqdm

from engine.layers import batch_invariant
from engine.layers.forward import ForwardBatch
from engine.layers.moe import Router
from engine.layers.parallel import Linear, ParallelLMHead, RowParallelLinear, VocabParallelEmbedding, matmul
from engine.layers.quant import ladder_rows
from engine.run.sample_params import SampleParams

if TYPE_CHECKING:
    from engine.run.runner import ModelRunner

# greedy; temperature with every filter, penalties and logprobs; plain temperature
_PARAMS = (
    SampleParams(seed=1, temperature=0.0),
    SampleParams(seed=2, temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.1,
                 frequency_penalty=0.5, presence_penalty=0.5, logprobs=True, top_logprobs=2),
    SampleParams(seed=3, temperature=1.0),
)


@torch.inference_mode()
def warm_up(runner: ModelRunner) -> float:
    """Seconds spent; leaves the sampler's slots and the replica untouched."""
    t0 = time.perf_counter()
    ps = runner.page_size
    pages = list(range(1, min(runner.num_pages, 1 + 3)))  # free pages: nothing is admitted yet
    n = min(2 * ps, len(pages) * ps - ps)  # a short prompt; the second request starts after one page
    if n < 1:
        return 0.0
    runner.sampler.warm()  # the race's kernel in both modes, whatever the slots below sample
    slots = list(range(min(len(_PARAMS), runner.cfg.max_running_requests)))
    for slot, params in zip(slots, _PARAMS, strict=False):
        runner.sampler.add(slot, params, prompt_ids=[1, 2, 3])
    try:
        prefill = _forward(runner, [0, ps, 0][: len(slots)], [n, n - ps if n > ps else 1, n][: len(slots)], pages)
        runner.sampler.sample(prefill, slots, [n] * len(slots))
        decode = _forward(runner, [n] * len(slots), [1] * len(slots), pages)
        runner.sampler.sample(decode, slots, [n + 1] * len(slots))
        if runner.device.type == "cuda" and len(slots) > 1:
            # one row has kernels of its own (a norm split across two GEMVs, MoE's one-token
            # chain with the norm in the router's GEMV): eager decode, without graphs, meets them
            _forward(runner, [n + 1], [1], pages)
    finally:
        for slot in slots:
            runner.sampler.remove(slot)
    if runner.device.type == "cuda":
        cfg = runner.cfg
        warm_gemms(runner.model, cfg.max_prefill_tokens + cfg.max_running_requests, cfg.max_running_requests,
                   runner.dtype, progress=runner.rank == 0)
        torch.cuda.synchronize(runner.device)
    return time.perf_counter() - t0


def gemm_rows(most: int) -> list[int]:
    """Row counts a GEMM is warmed at: quant.ladder_rows' counts up to `most` (every count up to 256,
    where cuBLAS's choice changes most often: decode batches, short prompts; every 16th up to 4096,
    every 64th beyond), and `most` itself. DeepGEMM runs only at ladder counts."""
    rows = sorted({r for r in map(ladder_rows, range(1, most + 1)) if r <= most})
    return rows if rows[-1] == most else [*rows, most]


def warm_gemms(model: torch.nn.Module, most_rows: int, most_sampled: int, act_dtype: torch.dtype,
               progress: bool = False) -> int:
    """Run every distinct projection and MoE router (weight shape, dtype, bias) through cuBLAS at
    `gemm_rows(most_rows)` and the LM head (or the tied embedding) at every sampled-row count:
    the kernels any step will pick are loaded before ready (module docstring). A quantized
    projection runs its own forward on `act_dtype` rows at the same counts (DeepGEMM compiles a
    kernel per tile choice on first use: minutes on a machine's first start, hence the bar).
    Returns the GEMMs run."""
    plan = _gemm_plan(model, most_rows, most_sampled)
    total = sum(len(g.counts) for g in plan)
    with tqdm(total=total, desc="warming GEMMs", unit="gemm", disable=not progress) as bar:
        for g in plan:
            _warm_one(g, act_dtype, bar)
    return total


class _Gemm(NamedTuple):
    """One distinct GEMM to warm: its module, row counts, bias (None for heads and routers) and fold."""

    module: torch.nn.Module
    counts: list[int]
    bias: torch.Tensor | None
    fold: str | None


def _gemm_plan(model: torch.nn.Module, most_rows: int, most_sampled: int) -> list[_Gemm]:
    """The distinct GEMMs the model runs, each with the row counts warm_gemms runs it at."""
    done: set[tuple] = set()
    plan = []
    for module in model.modules():
        head = isinstance(module, ParallelLMHead | VocabParallelEmbedding)
        if not (isinstance(module, Linear | Router) or head):  # Router: an MoE gate's GEMM (float32 or bf16)
            continue
        w = module.weight
        bias = None if head or isinstance(module, Router) else module.bias
        fold = _fold_of(module)
        quant = getattr(module, "quant", None)
        key = (tuple(w.shape), w.dtype, bias is not None, head, fold, quant)
        if w.is_meta or key in done or (quant is None and w.dtype not in (torch.bfloat16, torch.float16,
                                                                          torch.float32)):
            continue
        done.add(key)
        if quant is not None:  # its forward picks GEMV / triton / cuBLASLt / DeepGEMM (a JIT) by rows;
            # DeepGEMM runs at quant.ladder_rows(n): the ladder, and the top step's padded count
            plan.append(_Gemm(module, sorted({*gemm_rows(most_rows), ladder_rows(most_rows)}), bias, fold))
            continue
        counts = list(range(1, most_sampled + 1)) if head else gemm_rows(most_rows)
        if batch_invariant.enabled():  # one triton GEMM, compiled once per tile choice (invariant_gemm.tiles)
            from engine.layers.invariant_gemm import regime_rows

            counts = regime_rows(counts, *w.shape)
        plan.append(_Gemm(module, counts, bias, fold))
    return plan


def _warm_one(g: _Gemm, act_dtype: torch.dtype, bar: tqdm) -> None:
    module, counts, w = g.module, g.counts, g.module.weight
    quant = getattr(module, "quant", None)
    if quant is not None:
        x = torch.zeros(counts[-1], w.shape[1] * (2 if quant == "nvfp4" else 1), dtype=act_dtype, device=w.device)
        for n in counts:
            module.quant_forward(module, x[:n], module._local_gemv(x[:n]))  # the shard's own: no collective
            bar.update(1)
        return
    x = torch.zeros(counts[-1], w.shape[1], dtype=w.dtype, device=w.device)
    res = torch.zeros(counts[-1], w.shape[0], dtype=w.dtype, device=w.device) if g.fold == "residual" else None
    for n in counts:
        if g.fold == "norm":
            module(x[:n])
        elif res is not None:
            module.forward_add(x[:n], res[:n])
        else:
            matmul(x[:n], w, g.bias) if batch_invariant.enabled() else F.linear(x[:n], w, g.bias)
        bar.update(1)


def _fold_of(module: torch.nn.Module) -> str | None:
    """The epilogue a folded layer's GEMM runs with (models/llama.py fold_norms): "norm" (qkv, gate_up),
    "residual" (o_proj and down of a folded layer), else None."""
    if isinstance(module, Linear) and module.norm_eps is not None:
        return "norm"
    return "residual" if isinstance(module, RowParallelLinear) and module.adds_residual else None


def _forward(runner: ModelRunner, starts: list[int], lens: list[int], pages: list[int]) -> torch.Tensor:
    ids = [1 + i % 7 for i in range(sum(lens))]
    batch = ForwardBatch.build(ids, starts, lens, [pages] * len(lens), [1] * len(lens), runner.page_size,
                               runner.device)
    runner.backend.prepare(batch)
    return runner.model(batch, runner.kv, runner.backend)
