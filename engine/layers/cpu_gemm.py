"""CPU projections on oneDNN's packed weights, each on as many threads as pay.

A product runs on torch's OpenMP threads. The served worker's threads wait passively
(engine/run/__init__.py), so every parallel region first wakes the sleeping threads: measured
~100 us a call on a 2-core VM, more than a decode step's small products take on one thread
(default model, 16 rows, bf16: qkv 194 -> 116 us, o_proj 190 -> 70, down 201 -> 111 on one
thread; gate_up 303 / 294 even; the LM head 1.7 ms on two threads, 2.8 on one). So each product
shape measures, once, up to how many rows one thread is faster, and runs those row counts on one
thread. One thread is taken only where its output has the bits of all threads' on the same rows
(checked at the measurement), so the choice, which timing noise may change from run to run, never
changes an answer (deterministic inference's row blocks are proved on top of it)."""

from __future__ import annotations

import functools
import time

import structlog
import torch

log = structlog.get_logger()

ROW_STEPS = (1, 2, 4, 8, 16, 32, 64, 128)  # row counts measured, smallest first, while one thread wins
REPS = 7  # timed calls per row count and thread count (the least counts)
MARGIN = 0.9  # one thread is taken only when at most this fraction of all threads' time

_one_thread_rows: dict[tuple, int] = {}  # (N, K, dtype, threads) -> most rows run on one thread (0: none)


@functools.cache
def onednn_packs(dtype: torch.dtype) -> bool:
    """oneDNN can reorder a weight of this dtype for its CPU GEMM: float32 on the x86 CPUs it
    supports; bf16 needs AVX512 (BW, VL, DQ) or AVX-NE-CONVERT (an AVX2-only CPU refuses)."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), 16)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def cpu_pack(w: torch.Tensor) -> torch.Tensor | None:
    """`w` [N, K] reordered into oneDNN's blocked layout for x @ w.T, or None where that does
    not apply. Its GEMM reads that layout much faster than MKL reads the plain weight at
    decode sizes and as fast at prefill sizes (2 cores, default model: the float32
    projections and LM head of a 16-row step 77 -> 44 ms, AVX2; bf16 16-row decode step
    61 -> 50 ms, AVX512-BF16)."""
    if w.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16) or not onednn_packs(w.dtype):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(w.detach(), 16)  # 16: the row count it is tuned for


def _gemm(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def _on_threads(n: int, x: torch.Tensor, packed: torch.Tensor, back: int | None = None) -> torch.Tensor:
    """_gemm on n threads, then the calling thread's count set back (`back`: it, where known)."""
    back = torch.get_num_threads() if back is None else back
    torch.set_num_threads(n)  # the calling thread's OpenMP setting: ~0.1 us
    try:
        return _gemm(x, packed)
    finally:
        torch.set_num_threads(back)


def _seconds(one: functools.partial, all_: functools.partial) -> tuple[float, float]:
    """The least time of REPS calls of each, alternated: the least is what the product costs,
    whatever else the machine ran meanwhile (a worker measures while its server starts)."""
    best = [float("inf"), float("inf")]
    for _ in range(REPS):
        for i, f in enumerate((one, all_)):
            t = time.perf_counter()
            f()
            best[i] = min(best[i], time.perf_counter() - t)
    return best[0], best[1]


def one_thread_rows(packed: torch.Tensor) -> int:
    """The most rows (of ROW_STEPS, counted from 1 up while one thread keeps winning) at which
    this product runs on one thread rather than on all the calling thread's: measured on random
    rows, and only where one thread's output equals all threads' bit for bit."""
    k = packed.shape[1]
    rows = 0
    gen = torch.Generator().manual_seed(0)
    for m in ROW_STEPS:
        x = torch.randn(m, k, generator=gen).to(packed.dtype)
        one, all_ = functools.partial(_on_threads, 1, x, packed), functools.partial(_gemm, x, packed)
        if not torch.equal(one(), all_()):
            break
        t_one, t_all = _seconds(one, all_)
        if t_one > MARGIN * t_all:
            break
        rows = m
    return rows


@functools.cache
def _threads_switchable() -> bool:
    """torch's intra-op threads are OpenMP's, whose count a thread may set per call; torch's native
    pool refuses a new count once it has run (and warns each time)."""
    return "parallel backend: OpenMP" in torch.__config__.parallel_info()


def packed_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x @ w.T with `packed` = cpu_pack(w): on one thread up to the rows one_thread_rows found for
    its shape (measured at the first call), else on all."""
    threads = torch.get_num_threads()
    if threads == 1 or not _threads_switchable():
        return _gemm(x, packed)
    key = (*packed.shape, packed.dtype, threads)
    rows = _one_thread_rows.get(key)
    if rows is None:
        rows = _one_thread_rows[key] = one_thread_rows(packed)
        log.info("cpu projection threads", shape=list(packed.shape), one_thread_up_to_rows=rows, threads=threads)
    return _on_threads(1, x, packed, threads) if x.numel() // x.shape[-1] <= rows else _gemm(x, packed)
