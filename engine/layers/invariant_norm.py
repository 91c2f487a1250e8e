"""Deterministic inference's residual-stream RMSNorm on CUDA, and its fold into the GEMVs around it.

Under the mode a decode step of 1-8 rows runs each projection as the CUDA GEMV (invariant_gemv.cu)
and each norm between two projections as a launch of its own: two a layer, ~2.2 us each on an
H100 (docs/PERF.md, thirty-ninth session). Where the GPU's tuning turns `invariant_norm_fold` on:

* every residual-stream norm (a 2-D bf16 RMSNorm) of the model takes our kernel (`rms_norm`:
  r' = bf16(x + residual) into the residual, a row's sum of squares as per-16-element partials
  added by one warp in a fixed order, HF Llama's roundings), whatever the row count, so prefill,
  chunks and decode all have its bits;
* at 1-8 rows a producer GEMV (o_proj, down) adds its product into the residual in its epilogue
  and stores the partials (`add_into`), and the consumer GEMV (qkv, gate_up) sums them and
  normalizes its x tiles in shared memory (`normed`): the same arithmetic, so the same bits as
  the norm kernel between the two products, and the norm's launch is gone.

Off (the default), the norms are flashinfer's as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.layers import batch_invariant, invariant_gemv
from engine.layers.tuning import kernel_tuning


@dataclass(frozen=True)
class NormPartials:
    """The residual stream after a producer GEMV added into it (`add_into`), with its sums of
    squares (float32 [rows, hidden / 16]): what the consumer GEMV normalizes."""

    residual: torch.Tensor
    partials: torch.Tensor


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether this norm takes our kernel: deterministic inference on CUDA with the tuning's
    `invariant_norm_fold`, a 2-D bf16 input it takes, and the kernel built here."""
    return (batch_invariant.enabled() and x.is_cuda and kernel_tuning(x.device).invariant_norm_fold
            and invariant_gemv.norm_takes(x, weight)
            and invariant_gemv.library(invariant_gemv.arch(x.device)) is not None)


def rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(r'), r'): r' = bf16(x + residual), written into residual, or x where residual is None
    (`applies` checked by the caller)."""
    done = invariant_gemv.rms_norm(x, residual, weight, eps, _pdl(x.device))
    if done is None:
        raise RuntimeError("invariant rms_norm: the CUDA kernels are not built here")
    return done


def _gemv_takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, act: bool) -> bool:
    from engine.layers import invariant_gemm

    if not (1 <= x.shape[0] <= invariant_gemv.MAX_ROWS and invariant_gemm._cuda_gemv_takes(x, weight, bias)):
        return False
    return not act or invariant_gemv.act_takes(x, weight, invariant_gemm.split(*weight.shape))


def foldable(producer: torch.nn.Module, x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
             consumer: torch.nn.Module, act: bool) -> bool:
    """Whether producer(x) + residual, its norm and consumer(norm) fold into the two GEMVs: the
    norm takes our kernel, both layers are plain local products (Linear.plain_weight) the CUDA
    GEMV takes at these rows (the consumer with `act`: SwiGLU's epilogue too), hidden a multiple
    of 16."""
    if not batch_invariant.enabled() or not x.is_cuda:  # the mode-off path pays one call, not the checks
        return False
    mine, theirs = producer.plain_weight(), consumer.plain_weight()
    if mine is None or theirs is None or not residual.is_contiguous() or residual.shape[0] != x.shape[0]:
        return False
    if not applies(residual, norm_weight) or mine[0].shape[0] != residual.shape[1]:
        return False
    if not _gemv_takes(x, mine[0], mine[1], act=False) or (act and theirs[1] is not None):
        return False
    return _gemv_takes(residual, theirs[0], theirs[1], act=act) and residual.shape[1] % invariant_gemv.NORM_BLOCK == 0


def add_into(producer: torch.nn.Module, x: torch.Tensor, residual: torch.Tensor) -> NormPartials:
    """residual = bf16(producer(x) + residual) in place by the producer's GEMV, with its sums of
    squares (`foldable` checked by the caller)."""
    from engine.layers import invariant_gemm

    weight, bias = producer.plain_weight()
    n, k = weight.shape
    partials = torch.empty(x.shape[0], n // invariant_gemv.NORM_BLOCK, dtype=torch.float32, device=x.device)
    slices = invariant_gemm.split(n, k)
    if not invariant_gemv.gemv(x.contiguous(), weight, bias, residual, slices, invariant_gemv.stages_for(slices, k),
                               _pdl(x.device), partials=partials):
        raise RuntimeError("invariant GEMV: the CUDA kernels are not built here")
    return NormPartials(residual, partials)


def normed(consumer: torch.nn.Module, x: NormPartials, norm_weight: torch.Tensor, eps: float,
           act: bool) -> torch.Tensor:
    """consumer(rms_norm(x.residual)) by the consumer's GEMV, normalizing its tiles (the norm
    kernel's bits); with `act` the consumer is SwiGLU's gate_up and the result silu(gate) * up."""
    from engine.layers import invariant_gemm

    weight, bias = consumer.plain_weight()
    n, k = weight.shape
    r = x.residual
    out = torch.empty(r.shape[0], n // 2 if act else n, dtype=r.dtype, device=r.device)
    slices = invariant_gemm.split(n, k)
    if not invariant_gemv.gemv(r, weight, bias, out, slices, invariant_gemv.stages_for(slices, k), _pdl(r.device),
                               act=act, partials=x.partials, norm=(norm_weight, eps)):
        raise RuntimeError("invariant GEMV: the CUDA kernels are not built here")
    return out


def _pdl(device: torch.device) -> bool:
    from engine.layers import invariant_gemm

    return invariant_gemm._pdl(device)["PDL"]  # the GEMVs' choice (invariant_gemm_pdl)
