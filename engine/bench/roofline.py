"""The decode roofline: bytes one decode step must read, and the memory bandwidth to read them.

bytes/step = weight bytes + KV bytes read. Weights count every parameter once, except the
input embedding: a step gathers only `batch` of its rows, so embed_tokens counts zero
unless it is tied to (and so read in full as) the lm_head; and an MoE layer's routed expert
stacks (engine/layers/moe.py: w13, w2 and their fp8 scales), of which a step reads only the
experts its tokens are routed to: given the batch, the expected number of distinct experts
that `batch` tokens touch with top-k routing, uniform over the E experts (MOE_RULE; exactly k
at batch 1), times one expert's bytes. KV bytes = sum over the batch of the tokens attended to
times the per-token K+V bytes of all layers.
Bandwidth is measured in the same run by a large device-to-device copy (it reads and
writes every byte: bandwidth = 2 * bytes / time).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

from engine.layers.moe import MoE, experts_of

GIB = 1 << 30
MOE_RULE = "routed experts: E * (1 - (1 - k/E)^batch) expected distinct experts per MoE layer (uniform top-k)"


def experts_read(num_experts: int, top_k: int, batch: int) -> float:
    """Expected distinct experts of `num_experts` that `batch` tokens, each routed to `top_k`
    distinct experts uniformly at random, touch: top_k at batch 1, every expert as batch grows."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


def weight_bytes(model: nn.Module, tied_embeddings: bool, batch: int | None = None) -> int:
    """Bytes of parameters a decode step reads (shared parameters once, embedding gather excluded);
    with `batch`, an MoE layer's expert stacks only for the experts `batch` tokens are expected to
    read (module docstring), else in full."""
    share = {}  # id of an expert stack -> the fraction of its experts a step reads
    if batch is not None:
        for m in model.modules():
            if isinstance(m, MoE):
                spec = m.gate.spec
                for p in m.experts.parameters():
                    if experts_of(p):
                        share[id(p)] = experts_read(spec.num_experts, spec.top_k, batch) / spec.num_experts
    total = 0.0
    for name, p in model.named_parameters():  # de-duplicates tied parameters
        if "embed_tokens" in name and not tied_embeddings:
            continue
        total += p.nbytes * share.get(id(p), 1.0)
    return int(total)


def copy_bandwidth(device: torch.device, nbytes: int, iters: int = 10) -> float:
    """Memory bandwidth in bytes/s from copying an `nbytes` buffer (best of `iters`)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    src.fill_(1)
    dst = torch.empty_like(src)
    times = _cuda_copy_times(src, dst, iters) if device.type == "cuda" else _host_copy_times(src, dst, iters)
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return 2 * nbytes / min(times)


def _cuda_copy_times(src: torch.Tensor, dst: torch.Tensor, iters: int) -> list[float]:
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def _host_copy_times(src: torch.Tensor, dst: torch.Tensor, iters: int) -> list[float]:
    dst.copy_(src)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return times


def copy_size(device: torch.device, requested_gib: float | None) -> int:
    """Copy buffer size: requested, else 1 GiB on GPU (less if memory is short) / 256 MiB on CPU."""
    if requested_gib:
        return int(requested_gib * GIB)
    if device.type != "cuda":
        return GIB // 4
    free, _ = torch.cuda.mem_get_info(device)
    return max(64 << 20, min(GIB, int(free * 0.4) // 2))


def graph_us(fn: Callable[[], object], ops: int = 1, replays: int = 20) -> float:
    """us per call of fn inside a CUDA graph of `ops` calls, over `replays` replays (after one
    untimed call on the capture stream and one untimed replay): the kernels' time without the
    host's launch cost, as a decode step's graph runs them."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(ops):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (ops * replays)
