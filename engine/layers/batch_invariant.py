"""Deterministic inference: a token's logits, bit for bit, whatever else runs beside it.

A GEMM library picks its kernel, its blocking and its split of the reduction by the matrix
shape, so the same row of x @ W^T comes out with different low bits when x has 1, 7 or 300
rows (measured on CPU: oneDNN and MKL in float32 and bfloat16). What stays fixed is a
kernel's work for one fixed shape: rows of one call do not mix. So with the mode on:

* every projection and the LM head run on blocks of exactly `ROWS` rows (the last padded
  with zeros): a row is computed by the same kernel whatever the batch, prefill or decode;
* attention (`attend`) reduces over the KV in chunks of `kv_chunk` positions aligned to
  absolute position 0, with an online softmax whose running max, sum and output are merged
  chunk after chunk in order; each chunk is two batched GEMMs of one fixed shape per
  (block of `TOKENS` query tokens, KV head; the CUDA kernel's blocks hold 16 rows of tokens x
  query heads: kernel_tokens). A fresh prompt, a cached prefix, a chunked
  prefill and a decode step all take this one path, so a token sees the same sums in the same
  order. A row with no visible key in a chunk is left exactly unchanged by it (exp(0) = 1,
  p = 0), so visiting more chunks than a row needs changes nothing. The CUDA kernel groups the
  chunks in partitions of `KV_PART` positions, each from a fresh softmax state, merged in
  partition order by one formula, serially (prefill) or by split-KV programs and a merge kernel
  (decode): the same bits either way (docs/architecture.md, "Split-KV").

Everything else a token meets is per row and elementwise (norms, RoPE, SiLU, sampling).
The mode is set once per process (`enable`), before the model runs; engine/run/runner.py
turns it on from --enable-deterministic-inference.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.layers.kv_pool import KVPool

# rows per GEMM call: oneDNN's packed CPU weights are laid out for 16 rows (at decode batches up
# to 16 a 16-row bf16 GEMM costs what a 1-row one does); on a GPU fewer, larger calls
ROWS_BY_DEVICE = {"cpu": 16, "cuda": 64}
ROWS = 16
# batched GEMMs in calls of exactly this many matrices: cuBLAS picks its kernel by the batch
# count too (on the H200 entry 0 of a [n, 32, 128] x [n, 128, 64] bmm changed bits between
# n = 1 and every n > 1; scripts/det_probe.py). CPU (oneDNN) measured invariant: one call.
BMM_GROUP_BY_DEVICE = {"cuda": 64}
BMM_GROUP: int | None = None
TOKENS = 16  # query tokens per attention block (the torch path)
# the CUDA kernel's blocks hold DOT_ROWS rows (tl.dot's least M) of T tokens x G query heads per KV
# head, T = 16 // G (kernel_tokens): a decode row's block is its token and T - 1 pads, where 16
# tokens would compute 16 x G rows for it. H200, batch 256 ctx 1024, a layer: Llama's 32/8 heads
# 654 -> 258 us, Qwen3-0.6B's 16/8 376 -> 256 us (the KV read at 4.8 TB/s: 224 us). Prefill takes
# the same blocks: a row's bits depend on the tl.dot's M (4 tokens of Llama heads differed from 16
# in one of 24 bit checks on the H200), so every block of a model has one size.
DOT_ROWS = 16
KV_CHUNK = 64  # KV positions per attention chunk (at least a page)
# CUDA kernel: KV positions per partition (a whole number of chunks, aligned to position 0): each
# partition's softmax state starts fresh and the states merge in partition order, so a decode
# can compute its partitions in parallel (split-KV) with the bits of the serial kernel
KV_PART = 256
# split a decode step's KV when its (blocks x KV heads) programs are fewer than half this, into up
# to this many programs in all. H200, 32/8 heads, ctx 1024, the kernel's 4-token blocks (bench/results/
# invariant-attention-timing-h200-9dfdee4.txt): batch 1 best at 4 splits (9.9 us; 1 split 24.3),
# batch 8 at 4 (13.7; 2: 19.3), batch 32 even (1-4 splits 42.4-43.2), batch 64 unsplit (68.1; 2:
# 76.4): 256 picks each of those (128, tuned on 16-token blocks, gave batch 8 two splits)
SPLIT_PROGRAMS = 256

_enabled = False


def enable(on: bool, device_type: str = "cpu") -> None:
    global _enabled, ROWS, BMM_GROUP
    _enabled = on
    ROWS = ROWS_BY_DEVICE.get(device_type, 16)
    BMM_GROUP = BMM_GROUP_BY_DEVICE.get(device_type)


def enabled() -> bool:
    return _enabled


def in_blocks(f: Callable[..., torch.Tensor], size: int, *xs: torch.Tensor) -> torch.Tensor:
    """f(*xs) for an f whose output rows depend on the same rows of its inputs only, called on
    blocks of exactly `size` rows (dim 0; the last block padded with zeros)."""
    m = xs[0].shape[0]
    pad = -m % size
    if pad:
        xs = tuple(torch.cat([x, x.new_zeros(pad, *x.shape[1:])]) for x in xs)
    if m + pad == size:
        return f(*xs)[:m]
    return torch.cat([f(*(x[i : i + size] for x in xs)) for i in range(0, m + pad, size)])[:m]


def rows_of(x: torch.Tensor, f: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """f(x) for a row-wise f (a GEMM), on blocks of exactly ROWS rows of x."""
    return in_blocks(f, ROWS, x)


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.bmm, in calls of BMM_GROUP matrices where set."""
    return torch.bmm(a, b) if BMM_GROUP is None else in_blocks(torch.bmm, BMM_GROUP, a, b)


@dataclass
class Chunk:
    """The blocks that read KV chunk j (a prefix of the blocks, which are sorted by how many
    chunks they read), their pages and which (token, key) pairs are visible."""

    blocks: int
    pages: torch.Tensor  # int64 [blocks, kv_chunk / page_size]
    hidden: torch.Tensor  # bool [blocks, 1, TOKENS, 1, kv_chunk]: key after the token (masked)


@dataclass
class Plan:
    """One step's attention plan, shared by every layer."""

    rows: torch.Tensor  # int64 [nb, TOKENS]: the q row of each block token (pads repeat the last)
    real: torch.Tensor  # int64: the block tokens (flat index into nb * TOKENS) that are not pads
    chunks: list[Chunk]
    page_table: torch.Tensor
    page_size: int
    chunk: int
    # the same blocks for the CUDA kernel: (request int32, rows, positions int64 [nb, TOKENS],
    # chunks read int32, real int8 [nb, TOKENS])
    blocks: tuple[torch.Tensor, ...]
    kernel: bool  # attend by the CUDA kernel (then `chunks` is empty)
    parts: int = 0  # the most KV partitions a block reads (kernel)
    decode: bool = False  # every block is one token (the kernel may split its KV)
    scratch: tuple[torch.Tensor, torch.Tensor] | None = None  # split-KV states, made by the first layer


def kernel_fits(num_q_heads: int, num_kv_heads: int, head_dim: int, kv_dtype: torch.dtype,
                device: torch.device) -> bool:
    """Whether the CUDA kernel takes this geometry (power-of-two GQA group and head dim, a
    16/32-bit KV cache); else the torch ops below run, on any device."""
    g = num_q_heads // num_kv_heads
    return (device.type == "cuda" and g & (g - 1) == 0 and head_dim >= 16 and head_dim & (head_dim - 1) == 0
            and kv_dtype.itemsize >= 2)


def kv_chunk(page_size: int) -> int:
    """KV positions per attention chunk: KV_CHUNK, or a whole page where pages are larger."""
    return max(KV_CHUNK, page_size)


def kv_part(page_size: int) -> int:
    """KV positions per partition of the CUDA kernel: KV_PART rounded up to whole chunks."""
    c = kv_chunk(page_size)
    return -(-KV_PART // c) * c


def splits(blocks: int, kv_heads: int, parts: int) -> int:
    """Programs per (block, KV head) of a split decode: 1 (the serial kernel) where the blocks
    alone fill the GPU or the KV is one partition; the bits do not depend on it."""
    return max(1, min(parts, SPLIT_PROGRAMS // max(1, blocks * kv_heads)))


def split_rows(kv_heads: int) -> int:
    """The most decode rows that split (splits > 1): a CUDA graph's scratch covers these only."""
    return SPLIT_PROGRAMS // (2 * kv_heads)


def split_scratch(rows: int, parts: int, num_q_heads: int, head_dim: int,
                  device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 partition states of split decode: the token's output sums [rows, parts, Hq, D]
    and (max, sum) [rows, parts, 2, Hq]; only a decode token's G rows per KV head are kept
    (not the T * G rows of its kernel block)."""
    return (torch.empty(rows, parts, num_q_heads, head_dim, dtype=torch.float32, device=device),
            torch.empty(rows, parts, 2, num_q_heads, dtype=torch.float32, device=device))


def kernel_tokens(group: int) -> int:
    """Tokens per CUDA-kernel block for `group` query heads per KV head (DOT_ROWS rows)."""
    return max(1, min(TOKENS, DOT_ROWS // group))


def plan(page_table: torch.Tensor, seq_lens: list[int], extend_lens: list[int], page_size: int,
         kernel: bool = False, tokens: int = TOKENS) -> Plan:
    """Blocks of `tokens` consecutive new tokens of one request (the batch's rows in order);
    `kernel`: for the CUDA kernel (kernel_fits), which reads the pages itself and takes any
    block size (kernel_tokens: one per model, the same for every step); the torch path TOKENS."""
    if tokens != TOKENS and not kernel:
        raise ValueError(f"the torch attention path takes blocks of {TOKENS} tokens, not {tokens}")
    decode = all(n == 1 for n in extend_lens)
    chunk = kv_chunk(page_size)
    per_chunk = chunk // page_size
    rows, pos, req, reads, used = [], [], [], [], []
    row0 = 0
    for i, (seq, n) in enumerate(zip(seq_lens, extend_lens, strict=True)):
        start = seq - n
        for b in range(0, n, tokens):
            k = min(tokens, n - b)
            r = [row0 + b + t for t in range(k)] + [row0 + b + k - 1] * (tokens - k)
            p = [start + b + t for t in range(k)] + [start + b + k - 1] * (tokens - k)
            rows.append(r)
            pos.append(p)
            req.append(i)
            used.append(k)
            reads.append(p[k - 1] // chunk + 1)
        row0 += n
    order = sorted(range(len(rows)), key=lambda b: -reads[b])  # stable: ties keep batch order
    dev = page_table.device
    rows_t = torch.tensor([rows[b] for b in order], dtype=torch.int64, device=dev)
    real = [j * tokens + t for j, b in enumerate(order) for t in range(used[b])]
    real_t = torch.tensor(real, dtype=torch.int64, device=dev)
    pos_t = torch.tensor([pos[b] for b in order], dtype=torch.int64, device=dev)
    req_t = torch.tensor([req[b] for b in order], dtype=torch.int64, device=dev)
    width = page_table.shape[1]
    real_mask = torch.zeros(len(order) * tokens, dtype=torch.int8)
    real_mask[real] = 1
    blocks = (req_t.to(torch.int32), rows_t, pos_t,
              torch.tensor([reads[b] for b in order], dtype=torch.int32, device=dev),
              real_mask.view(-1, tokens).to(dev))
    chunks: list[Chunk] = []
    if kernel:
        per_part = kv_part(page_size) // chunk
        parts = -(-reads[order[0]] // per_part) if order else 0
        return Plan(rows_t, real_t, chunks, page_table, page_size, chunk, blocks, kernel, parts, decode)
    for j in range(reads[order[0]] if order else 0):
        nb = sum(1 for b in order if reads[b] > j)
        cols = torch.arange(j * per_chunk, (j + 1) * per_chunk, device=dev).clamp_(max=width - 1)
        pages = page_table[req_t[:nb]][:, cols].to(torch.int64)
        key = torch.arange(j * chunk, (j + 1) * chunk, device=dev)
        hidden = key[None, None, :] > pos_t[:nb, :, None]
        chunks.append(Chunk(nb, pages, hidden[:, None, :, None, :]))
    return Plan(rows_t, real_t, chunks, page_table, page_size, chunk, blocks, kernel)


def attend(q: torch.Tensor, p: Plan, kv_pool: KVPool, layer: int) -> torch.Tensor:
    """Causal attention of q [T, Hq, D] over `layer`'s paged KV by the plan; [T, Hq, D] in q's dtype."""
    _, hq, d = q.shape
    nb = p.rows.shape[0]
    if p.kernel:  # one launch (two for split-KV), the same structure
        s = splits(nb, kv_pool.num_kv_heads, p.parts) if p.decode else 1
        if s > 1 and p.scratch is None:
            p.scratch = split_scratch(nb, p.parts, hq, d, q.device)
        return attend_blocks(q, p.blocks, p.page_table, kv_pool, layer, s, p.scratch)
    out = torch.empty_like(q)
    if nb == 0:
        return out
    hkv = kv_pool.num_kv_heads
    g = hq // hkv
    qb = q[p.rows].float().view(nb, TOKENS, hkv, g, d).permute(0, 2, 1, 3, 4).reshape(nb * hkv, TOKENS * g, d)
    qb = qb * d**-0.5
    m = torch.full((nb * hkv, TOKENS * g, 1), float("-inf"), device=q.device)
    acc = torch.zeros(nb * hkv, TOKENS * g, d + 1, device=q.device)  # [.., :d] output, [.., d] the sum
    for c in p.chunks:
        n = c.blocks * hkv
        k, v = kv_pool.gather_pages(layer, c.pages, kv_pool.dtype)  # [blocks, chunk, Hkv, D] as stored
        chunk = k.shape[1]
        # float32 and the GEMMs' layouts in one copy each; V gets a column of ones, so that the
        # same GEMM sums the probabilities (no separate reduction)
        kt = torch.empty(n, d, chunk, device=q.device)
        kt.view(c.blocks, hkv, d, chunk).copy_(k.permute(0, 2, 3, 1))
        v1 = torch.empty(n, chunk, d + 1, device=q.device)
        v1.view(c.blocks, hkv, chunk, d + 1)[..., :d].copy_(v.permute(0, 2, 1, 3))
        v1[..., d] = 1.0
        s = bmm(qb[:n], kt)
        s.view(c.blocks, hkv, TOKENS, g, chunk).masked_fill_(c.hidden, float("-inf"))
        m_old = m[:n]
        m_new = torch.maximum(m_old, s.amax(-1, keepdim=True))
        pv = bmm(s.sub_(m_new).exp_(), v1)
        acc[:n].mul_(m_old.sub_(m_new).exp_()).add_(pv)
        m[:n] = m_new
    o = (acc[..., :d] / acc[..., d:]).view(nb, hkv, TOKENS, g, d).permute(0, 2, 1, 3, 4).reshape(nb * TOKENS, hq, d)
    out[p.rows.view(-1)[p.real]] = o[p.real].to(q.dtype)
    return out


def attend_blocks(q: torch.Tensor, blocks: tuple[torch.Tensor, ...], page_table: torch.Tensor, kv_pool: KVPool,
                  layer: int, n_splits: int = 1,
                  scratch: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """attend by the CUDA kernel over `blocks` (Plan.blocks' form, in any order: each block is
    one program that reads only its own entries and writes only its own real rows); n_splits > 1:
    split-KV (decode blocks only) with `scratch` (split_scratch), the same bits."""
    from engine.layers import triton_ops

    ps = kv_pool.page_size
    return triton_ops.invariant_attention(q.contiguous(), kv_pool.k[layer], kv_pool.v[layer], ps, page_table, blocks,
                                          kv_chunk(ps), kv_part(ps), n_splits, scratch)


class DecodeBlocks:
    """A decode batch's kernel blocks in static device buffers, for CUDA graphs: row i is block
    i (its token, then tokens - 1 pads repeating it), filled from the rows' KV lengths by device
    ops of fixed shapes only (no host read), so a captured decode rebuilds them on every replay.
    They equal `plan(..., tokens=tokens).blocks` of the same decode batch up to the blocks'
    order (plan puts the most chunks first; the kernel's result does not depend on the order)."""

    def __init__(self, max_rows: int, device: torch.device | str, tokens: int = TOKENS) -> None:
        idx = torch.arange(max_rows, dtype=torch.int64, device=device)
        self.req = idx.to(torch.int32)
        self.rows = idx[:, None].expand(max_rows, tokens).contiguous()
        self.pos = torch.zeros(max_rows, tokens, dtype=torch.int64, device=device)
        self.reads = torch.ones(max_rows, dtype=torch.int32, device=device)
        self.real = torch.zeros(max_rows, tokens, dtype=torch.int8, device=device)
        self.real[:, 0] = 1

    def fill(self, seq_lens: torch.Tensor, page_size: int) -> tuple[torch.Tensor, ...]:
        """The blocks of decode rows with KV lengths seq_lens (int32 [b], device; the new token
        at position seq_len - 1): (request, rows, positions, chunks read, real) as plan's."""
        b = seq_lens.shape[0]
        pos, reads = self.pos[:b], self.reads[:b]
        torch.sub(seq_lens[:, None].expand(b, pos.shape[1]), 1, out=pos)
        c = kv_chunk(page_size)
        torch.floor_divide(seq_lens + (c - 1), c, out=reads)  # (pos // c) + 1 chunks from position 0
        return self.req[:b], self.rows[:b], pos, reads, self.real[:b]
