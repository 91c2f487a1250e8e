"""Deterministic paged attention on the CPU: cpu_attention.c, built here with the machine's C
compiler and called through ctypes.

With deterministic inference (a CPU's default: ServerConfig.deterministic) a CPU attends every
row (prefill, chunked prefill behind a cached prefix, decode) by this one kernel, which reads the
KV pages in place. A query row's
arithmetic is fixed by the C code alone (the file's header says how), so its bits do not depend
on the batch, on the blocks of tokens the rows are computed in, or on which thread runs them:
no probe is needed, unlike the vendor GEMMs of the torch path (batch_invariant.softmax_chunks),
which stays for CUDA geometries without a kernel and for a machine without a C compiler.

Measured on 2 cores (Xeon, AVX-512), the default model's 9 / 3 heads, a layer: a 32-row decode
at 160 tokens 0.85 ms (the torch path 2.5 ms, the mode-off gathers and SDPA 1.2 ms); an 8,191-token
prefill 540-575 ms (torch's CPU flash SDPA, not invariant: 128 ms in bf16 on the AMX tiles, 339 ms
in float32; docs/PERF.md, "CPU attention kernel"). With bf16 queries and KV on a CPU with bf16 dot
products the kernel's scores and values are sums of bf16 pairs (the C file's header): on AMX's tiles
a whole 8k-token prefill of the default model 17.7 -> 8.9 s (docs/PERF.md, "CPU attention on the AMX
tiles"); on AVX512-BF16 without AMX (AMD Zen 4) a layer's 8k-token prefill 820 -> 357 ms
(docs/PERF.md, "CPU attention on AVX512-BF16").

The library (engine/layers/cpu_kernels.py) is compiled once per source, compiler and CPU into the
cache directory, at the backend's bind: before the engine says ready.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from engine.layers import cpu_kernels
from engine.layers.cpu_kernels import library

ROWS = 192  # query rows (tokens x query heads of one KV head) of a block, at most (block_tokens)
SCORES = 1 << 22  # and its scores (rows x keys) within this many floats: 16 MiB a thread
KV_DTYPES = cpu_kernels.DTYPES


def bf16_dot_unit() -> str | None:
    """The unit of the built kernel's bf16 pairs path: "amx", "avx512_bf16" (compiled for a CPU
    with it, -march=native), or None."""
    lib = library()
    return None if lib is None else {1: "amx", 2: "avx512_bf16"}.get(lib.strata_bf16_dot_unit())


@functools.cache
def bf16_dot_applies(dq: int, dv: int, page_size: int, kv_dtype: int) -> bool:
    """Whether bf16 queries of this geometry take the pairs path (asked of the kernel once; fixed for
    the process, so every row of an engine takes one path)."""
    lib = library()
    return lib is not None and bool(lib.strata_bf16_dot(dq, dv, page_size, kv_dtype))


def fits(kv_dtype: torch.dtype, dq: int) -> bool:
    """Whether the kernel takes this KV cache (float32 or bf16, a head dim up to 1024) here."""
    return kv_dtype in KV_DTYPES and dq <= 1024 and library() is not None


def block_tokens(group: int, keys: int) -> int:
    """Tokens per block for `group` query heads per KV head and a request of `keys` keys: up to 64,
    ROWS query rows at most, within SCORES (a block's keys, converted and transposed once a tile,
    serve all its rows: an 8k-token prefill of the default model's heads, a layer, 637 ms in 16-token
    blocks, 592 in 64-token ones, on 2 cores)."""
    return max(1, min(64, ROWS // group, SCORES // (group * max(1, keys))))


@dataclass
class Plan:
    """One step's blocks, shared by every layer: int32 [n, 4] (request, first q row, tokens,
    position of the first) and the item range each thread takes."""

    blocks: torch.Tensor
    page_table: torch.Tensor  # int64 [requests, width], contiguous
    ranges: list[tuple[int, int]]  # items [first, last) per thread; item = block x KV heads + head


def plan(page_table: torch.Tensor, seq_lens: list[int], extend_lens: list[int], kv_heads: int, group: int = 1,
         tokens: int | None = None) -> Plan:
    """Blocks of consecutive new tokens of one request, block_tokens(group, its keys) each or
    `tokens` (MLA's plan takes 1: its rows are its many heads), and the blocks' items split
    between torch's threads by their work (tokens x keys). The blocks do not change a row's bits."""
    blocks, row0 = [], 0
    for i, (seq, n) in enumerate(zip(seq_lens, extend_lens, strict=True)):
        size = tokens or block_tokens(group, seq)
        for b in range(0, n, size):
            blocks.append((i, row0 + b, min(size, n - b), seq - n + b))
        row0 += n
    arr = np.array(blocks, dtype=np.int32).reshape(-1, 4)
    ends = arr[:, 3].astype(np.int64) + arr[:, 2]
    cost = np.repeat(arr[:, 2] * ends, kv_heads).cumsum()
    threads = max(1, min(torch.get_num_threads(), len(cost)))
    cuts = [0, *(int(np.searchsorted(cost, cost[-1] * k / threads)) + 1 for k in range(1, threads)), len(cost)]
    return Plan(torch.from_numpy(arr), page_table.to(torch.int64).contiguous(),
                [(a, b) for a, b in zip(cuts, cuts[1:], strict=False) if b > a])


def attend(q: torch.Tensor, p: Plan, k: torch.Tensor, v: torch.Tensor, page_size: int, scale: float,
           dv: int | None = None, out_dtype: torch.dtype = torch.float32,
           lse: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of q [T, Hq, dq] over one layer's pages k [slots, Hkv, dq] and v [slots,
    Hkv, >= dv] (v's first dv values of each row; MLA: v is k, dv its latent rank): [T, Hq, dv] in
    out_dtype (float32, or bf16: each value rounded once, as .to() would), each row's bits whatever
    the plan's blocks and threads. q is read in place where its heads are adjacent (a view of the
    fused QKV projection's output: tokens a row stride apart). `lse` (float32 [T, Hq], contiguous), where
    given, receives each row's log-sum-exp of its scaled scores (context parallelism merges by it)."""
    lib = library()
    t, hq, dq = q.shape
    hkv = k.shape[1]
    dv = v.shape[2] if dv is None else dv
    if k.stride(2) != 1 or k.stride(0) != hkv * k.stride(1) or v.stride(2) != 1 or v.stride(0) != hkv * v.stride(1):
        raise ValueError("cpu_attention: KV rows must be (slot, head)-major with contiguous head dims")
    # bf16 queries over bf16 keys: sums of bf16 pairs where the CPU has the unit (the C file's header)
    pairs = q.dtype == torch.bfloat16 and bf16_dot_applies(dq, dv, page_size, KV_DTYPES[k.dtype])
    qx = q if pairs else q.float()
    if not cpu_kernels.heads_packed(qx):
        qx = qx.contiguous()
    out = torch.empty(t, hq, dv, dtype=out_dtype)
    if lse is not None and (lse.shape != (t, hq) or lse.dtype != torch.float32 or not lse.is_contiguous()):
        raise ValueError(f"cpu_attention: lse must be float32 [{t}, {hq}] contiguous, "
                         f"got {lse.dtype} {tuple(lse.shape)}")
    if t == 0:
        return out

    def run(first: int, last: int) -> None:
        rc = lib.strata_attend(qx.data_ptr(), qx.stride(0), k.data_ptr(), v.data_ptr(), k.stride(1), v.stride(1),
                               KV_DTYPES[k.dtype], hkv, hq, dq, dv, page_size, scale, p.page_table.data_ptr(),
                               p.page_table.shape[1], p.blocks.data_ptr(), first, last, out.data_ptr(), int(pairs),
                               int(out_dtype == torch.bfloat16), None if lse is None else lse.data_ptr())
        if rc != 0:
            raise MemoryError("cpu_attention: no memory for the kernel's scratch")

    cpu_kernels.run_split(run, p.ranges)
    return out
