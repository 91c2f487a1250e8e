"""Deterministic inference: a token's logits, bit for bit, whatever else runs beside it.

A GEMM library picks its kernel, its blocking and its split of the reduction by the matrix
shape, so the same row of x @ W^T comes out with different low bits when x has 1, 7 or 300
rows (measured on CPU: oneDNN and MKL in float32 and bfloat16). What stays fixed is a
kernel's work for one fixed shape: rows of one call do not mix. So with the mode on:

* every projection and the LM head run on blocks of exactly `ROWS` rows (the last padded
  with zeros): a row is computed by the same kernel whatever the batch, prefill or decode. On
  a CPU, larger blocks too where a probe at the GEMM's first call proved that they give each
  row the bits of ROWS-row blocks (`block_sizes`: the vendor kernel's choice is the machine's);
* attention (`attend`) reduces over the KV in chunks of `kv_chunk` positions aligned to
  absolute position 0. A fresh prompt, a cached prefix, a chunked prefill and a decode step
  all take one path, so a token sees the same sums in the same order. The torch path
  (`softmax_chunks`): per (block of `TOKENS` query tokens, KV head) and chunk, two batched
  GEMMs of one fixed shape (scores, then exp-scores times the values); the row's maximum over
  all its keys (exact); the chunks' sums (and the exp-scores') added in chunk order. A chunk
  a row does not see adds exact zeros, so a block attended with longer rows beside it, over
  more chunks than it needs, keeps its bits. The CUDA kernel (blocks of 16 rows of tokens x
  query heads: kernel_tokens) runs an online softmax over the chunks in partitions of
  `KV_PART` positions, each from a fresh softmax state, merged in partition order by one
  formula, serially (prefill) or by split-KV programs and a merge kernel (decode): the same
  bits either way (docs/architecture.md, "Split-KV"). On a CPU attention takes neither: the C
  kernel of engine/layers/cpu_attention.py (the torch path only where it does not build).

Everything else a token meets is per row and elementwise (norms, RoPE, SiLU, sampling).
The mode is set once per process (`enable`), before the model runs; engine/run/assembly.py
turns it on from ServerConfig.deterministic (the flag; a CPU's default).
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
# CPU: larger row blocks tried for each GEMM at its first call (block_sizes), kept where they give
# the bits of ROWS-row blocks. Measured (2 cores, Xeon with AMX, oneDNN's packed weights): float32
# invariant at every count from 2 rows up; bfloat16 at 16 and 32 and, by shape, some of 768-2048
# (AMX sums otherwise from 48 rows up). A 1024-token float32 prefill of the default model: 2.9 s in
# 16-row blocks, 1.4 s in these (1.3 s with the mode off)
LADDER = (2048, 1536, 1024, 768, 512, 384, 256, 192, 128, 96, 64, 48, 32)
# the largest probe block of a GEMM: 2 x rows x N x K at most this. 2^33 lets the default model's
# gate_up (3072 x 576) prove 2048 rows, a whole default prefill step in one call: at 2^32 its 2048
# rows went as two calls and a 12 MiB cat, 16 x 128 prefill 619-669 -> 574-608 ms (bf16, 2 cores)
PROBE_MACS = 1 << 33
_sizes: dict[tuple, tuple[int, ...]] = {}  # GEMM key -> block_sizes
# batched GEMMs in calls of exactly this many matrices: cuBLAS picks its kernel by the batch
# count too (on the H200 entry 0 of a [n, 32, 128] x [n, 128, 64] bmm changed bits between
# n = 1 and every n > 1; scripts/det_probe.py). CPU (oneDNN) measured invariant: one call.
BMM_GROUP_BY_DEVICE = {"cuda": 64}
BMM_GROUP: int | None = None
TOKENS = 16  # query tokens per attention block (the torch path; fewer in decodes where decode_tokens allows)
# the torch path attends a group of blocks at once, over the chunks of its first (longest) block:
# about this many floats in each of its per-(block, chunk) tensors (scores, expanded queries,
# chunk outputs: pairs x query rows x max(head dim, chunk)), so 32 MiB each
GROUP_FLOATS = 1 << 23
_few_tokens: dict[tuple, int] = {}  # decode_tokens' probes
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
# can compute its partitions in parallel (split-KV) with the bits of the serial kernel. 128 against
# 256 (H100, Llama-3.1-8B, mode on, ctx 1024, alternated; docs/PERF.md, fortieth session): batch 1
# 5.964 against 6.022 ms (8 splits), batch 8 6.481 against 6.421 (4 splits of two partitions each)
KV_PART = 128
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


def rows_of(x: torch.Tensor, f: Callable[[torch.Tensor], torch.Tensor], key: tuple | None = None) -> torch.Tensor:
    """f(x) for a row-wise f (a GEMM), on blocks of exactly ROWS rows of x; on a CPU with a `key`
    naming the GEMM (its kind, weight shape and dtype), on blocks of the sizes `block_sizes` proved
    to give each row the bits of ROWS-row blocks."""
    if key is None or x.device.type != "cpu":
        return in_blocks(f, ROWS, x)
    key = (*key, torch.get_num_threads())  # proved with the threads that run it
    sizes = _sizes.get(key)
    if sizes is None:
        sizes = _sizes[key] = block_sizes(f, x.shape[1], x.dtype)
    return _in_sizes(f, sizes, x)


def block_sizes(f: Callable[[torch.Tensor], torch.Tensor], k: int, dtype: torch.dtype) -> tuple[int, ...]:
    """The row counts of LADDER (within PROBE_MACS) at which f's rows have the bits of ROWS-row
    blocks, on random rows of width k, and ROWS; largest first. A GEMM's arithmetic does not
    depend on the values, so equal bits here mean equal bits on any rows of that count. Each
    count is checked on blocks over all the probe's rows, not one block: another summation order
    flips a bf16 output's rounding rarely (1-7 of 37k-98k outputs at 64 rows, AMX), so one small
    block could pass by chance."""
    n = f(torch.zeros(ROWS, k, dtype=dtype)).shape[1]
    top = max([s for s in LADDER if 2 * s * n * k <= PROBE_MACS], default=ROWS)
    x = torch.randn(top, k, generator=torch.Generator().manual_seed(0)).to(dtype)
    ref = torch.cat([f(x[i : i + ROWS]) for i in range(0, top, ROWS)])
    return tuple(s for s in LADDER if s <= top and all(torch.equal(f(x[i : i + s]), ref[i : i + s])
                                                       for i in range(0, top - s + 1, s))) + (ROWS,)


CALL_ROWS = 64  # a GEMM call's fixed cost in rows' worth (2 cores, AMX: gate_up ~130, down ~56)


def _greedy(sizes: tuple[int, ...], m: int) -> list[int]:
    """m rows as the largest sizes they fill, the last block padded to ROWS."""
    out = []
    while m > 0:
        s = next((s for s in sizes if s <= m), ROWS)
        out.append(s)
        m -= min(s, m)
    return out


def block_rows(sizes: tuple[int, ...], m: int) -> list[tuple[int, int]]:
    """(block size, rows of x in it) for m rows: at each remainder, the least size that holds it
    (zero-padded) where that costs less than the blocks it fills (CALL_ROWS a call, plus rows),
    else the largest size it fills. Any split into proved sizes gives each row the same bits: this
    one only sets the cost (bf16 proved ladders are sparse on AMX, e.g. 1024 / 768 / 32 / 16)."""
    out, i = [], 0
    while i < m:
        r = m - i
        up = [s for s in sizes if s >= r]
        if not up:  # more rows than the largest size holds
            s = sizes[0]
        else:
            fill = _greedy(sizes, r)
            s = up[-1] if CALL_ROWS + up[-1] <= CALL_ROWS * len(fill) + sum(fill) else fill[0]
        out.append((s, min(s, r)))
        i += s
    return out


def _in_sizes(f: Callable[[torch.Tensor], torch.Tensor], sizes: tuple[int, ...], x: torch.Tensor) -> torch.Tensor:
    """f(x) in blocks of the given row counts (largest first; the last one, ROWS, the least), as
    block_rows splits its rows."""
    out, i = [], 0
    for s, r in block_rows(sizes, x.shape[0]):
        xb = x[i : i + r]
        if r < s:
            xb = torch.cat([xb, xb.new_zeros(s - r, *xb.shape[1:])])
        out.append(f(xb)[:r])
        i += r
    return out[0] if len(out) == 1 else torch.cat(out)


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.bmm, in calls of BMM_GROUP matrices where set."""
    return torch.bmm(a, b) if BMM_GROUP is None else in_blocks(torch.bmm, BMM_GROUP, a, b)


@dataclass
class Group:
    """Blocks start..end (sorted by how many chunks they read, most first) attended together over
    their first block's `chunks` KV chunks: their pages, and which (token, key) pairs are hidden."""

    start: int
    end: int
    chunks: int
    pages: torch.Tensor  # int64 [blocks, chunks * kv_chunk / page_size]
    hidden: torch.Tensor  # bool [blocks, chunks, tokens, 1, kv_chunk]: key after the token (masked)


@dataclass
class Plan:
    """One step's attention plan, shared by every layer."""

    rows: torch.Tensor  # int64 [nb, TOKENS]: the q row of each block token (pads repeat the last)
    real: torch.Tensor  # int64: the block tokens (flat index into nb * TOKENS) that are not pads
    groups: list[Group]  # the torch path's
    page_table: torch.Tensor
    page_size: int
    chunk: int
    # the same blocks for the CUDA kernel (empty on the torch path): (request int32, rows, positions
    # int64 [nb, TOKENS], chunks read int32, real int8 [nb, TOKENS])
    blocks: tuple[torch.Tensor, ...]
    kernel: bool  # attend by the CUDA kernel (then `groups` is empty)
    tokens: int = TOKENS  # per block
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


def group_chunks(q_heads: int, tokens: int, head_dim: int, page_size: int) -> int:
    """(block, chunk) pairs a group of the torch path: GROUP_FLOATS over one pair's floats."""
    return max(1, GROUP_FLOATS // (q_heads * tokens * max(head_dim, kv_chunk(page_size))))


def plan(page_table: torch.Tensor, seq_lens: list[int], extend_lens: list[int], page_size: int,
         kernel: bool = False, tokens: int = TOKENS, group_chunks: int = 512, decodes: bool | None = None) -> Plan:
    """Blocks of `tokens` consecutive new tokens of one request (the batch's rows in order);
    `kernel`: for the CUDA kernel (kernel_fits), which reads the pages itself and takes any
    block size (kernel_tokens: one per model, the same for every step); the torch path takes
    TOKENS, or fewer for decode rows only (decode_tokens), in groups of `group_chunks` (block,
    chunk) pairs at most (a single block reading more is a group of its own). `decodes`: the
    requests with one new token only (True) or the others only (False); None: all."""
    decode = all(n == 1 for n in extend_lens if decodes is None or (n == 1) == decodes)
    if not kernel and tokens != TOKENS and not (decode and 0 < tokens < TOKENS):
        raise ValueError(f"the torch attention path takes blocks of {TOKENS} tokens (fewer in decodes), not {tokens}")
    chunk = kv_chunk(page_size)
    per_chunk = chunk // page_size
    rows, pos, req, reads, used = [], [], [], [], []
    row0 = 0
    for i, (seq, n) in enumerate(zip(seq_lens, extend_lens, strict=True)):
        if decodes is not None and (n == 1) != decodes:
            row0 += n
            continue
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
    if kernel:
        real_mask = torch.zeros(len(order) * tokens, dtype=torch.int8)
        real_mask[real] = 1
        blocks = (req_t.to(torch.int32), rows_t, pos_t,
                  torch.tensor([reads[b] for b in order], dtype=torch.int32, device=dev),
                  real_mask.view(-1, tokens).to(dev))
        per_part = kv_part(page_size) // chunk
        parts = -(-reads[order[0]] // per_part) if order else 0
        return Plan(rows_t, real_t, [], page_table, page_size, chunk, blocks, kernel, tokens, parts, decode)
    groups: list[Group] = []
    b, nb = 0, len(order)
    while b < nb:
        c = reads[order[b]]
        e = min(nb, b + max(1, group_chunks // c))
        cols = torch.arange(c * per_chunk, device=dev).clamp_(max=width - 1)
        hidden = torch.arange(c * chunk, device=dev)[None, None, :] > pos_t[b:e, :, None]  # [blocks, tokens, keys]
        hidden = hidden.view(e - b, tokens, c, chunk).transpose(1, 2)[:, :, :, None, :]
        groups.append(Group(b, e, c, page_table[req_t[b:e]][:, cols].to(torch.int64), hidden))
        b = e
    return Plan(rows_t, real_t, groups, page_table, page_size, chunk, (), kernel, tokens, decode=decode)


def attend(q: torch.Tensor, p: Plan, kv_pool: KVPool, layer: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of q [T, Hq, D] over `layer`'s paged KV by the plan; [T, Hq, D] in q's dtype
    (the torch path: the plan's rows of `out` where given, its other rows left as they are)."""
    _, hq, d = q.shape
    nb = p.rows.shape[0]
    if p.kernel:  # one launch (two for split-KV), the same structure
        s = splits(nb, kv_pool.num_kv_heads, p.parts) if p.decode else 1
        if s > 1 and p.scratch is None:
            p.scratch = split_scratch(nb, p.parts, hq, d, q.device)
        return attend_blocks(q, p.blocks, p.page_table, kv_pool, layer, s, p.scratch)
    return _attend_groups(q, p, kv_pool, layer, out)


def _attend_groups(q: torch.Tensor, p: Plan, kv_pool: KVPool, layer: int, out: torch.Tensor | None) -> torch.Tensor:
    """attend by the torch path: each group of blocks through softmax_chunks."""
    _, hq, d = q.shape
    nb = p.rows.shape[0]
    out = torch.empty_like(q) if out is None else out
    if nb == 0:
        return out
    hkv, t = kv_pool.num_kv_heads, p.tokens
    g = hq // hkv
    qb = (q[p.rows].float() * d**-0.5).view(nb, t, hkv, g, d).permute(2, 0, 1, 3, 4).reshape(hkv, nb, t * g, d)
    o = torch.empty(hkv, nb, t * g, d, device=q.device)
    for gr in p.groups:
        k, v = kv_pool.gather_heads(layer, gr.pages)  # [Hkv, blocks, keys, D] as stored
        o[:, gr.start : gr.end] = softmax_chunks(qb[:, gr.start : gr.end], k, v, gr.hidden, gr.chunks)
    o = o.view(hkv, nb, t, g, d).permute(1, 2, 0, 3, 4).reshape(nb * t, hq, d)
    out[p.rows.view(-1)[p.real]] = o[p.real].to(q.dtype)
    return out


def softmax_chunks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hidden: torch.Tensor,
                   chunks: int) -> torch.Tensor:
    """Attention of scaled float32 query rows q [H, b, M, Dq] over `chunks` KV chunks of keys k
    [H, b, keys, Dq] and values v [H, b, keys, Dv] (KVPool.gather_heads; `hidden` masks the keys
    after each of the M // tokens query heads' token): [H, b, M, Dv]. Each (head, block, chunk) is
    two batched GEMMs of one shape whatever the batch (scores [M, Dq] x [Dq, chunk], then
    exp-scores [M, chunk] x values [chunk, Dv]) and a sequential sum of its exp-scores; the row's
    maximum is over all its keys (exact); the chunks' sums are added in chunk order. A chunk that
    a row does not see adds exact zeros, so a row's bits do not depend on how many chunks its
    group reads."""
    h, b, m, dq = q.shape
    dv, chunk = v.shape[-1], k.shape[2] // chunks
    n = h * b * chunks
    qe = q[:, :, None].expand(h, b, chunks, m, dq).reshape(n, m, dq)
    s = bmm(qe, k.float().reshape(n, chunk, dq).transpose(1, 2))
    s.view(h, b, chunks, hidden.shape[2], -1, chunk).masked_fill_(hidden, float("-inf"))
    s = s.view(h, b, chunks, m, chunk)
    s.sub_(s.amax(dim=(2, 4), keepdim=True)).exp_()
    num = bmm(s.view(n, m, chunk), v.float().reshape(n, chunk, dv)).view(h, b, chunks, m, dv)
    return _in_order(num, 2) / _in_order(_in_order(s, 4), 2)[..., None]


def _in_order(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The sum over `dim`, term after term from index 0: on a CPU by cumsum, a sequential scan
    that accumulates in double (one call whatever the count); elsewhere by one add a term."""
    if x.device.type == "cpu":
        return x.cumsum(dim).select(dim, -1)
    acc = x.select(dim, 0).clone()
    for j in range(1, x.shape[dim]):
        acc.add_(x.select(dim, j))
    return acc


def decode_tokens(rows: int, dq: int, dv: int, chunk: int, device: torch.device) -> int:
    """Tokens per block of the torch path's decode rows: the fewest (1, 2, 4 or 8) at which the
    batched GEMMs give a token's `rows` query rows the bits of a TOKENS-token block, else TOKENS
    (probed once per geometry and device; a decode token's block is its token and pads: 1
    computes 16x fewer rows than TOKENS)."""
    key = (rows, dq, dv, chunk, device.type, torch.get_num_threads())
    if key not in _few_tokens:
        _few_tokens[key] = next((t for t in (1, 2, 4, 8) if _blocks_same(t, rows, dq, dv, chunk, device)), TOKENS)
    return _few_tokens[key]


def _blocks_same(tokens: int, rows: int, dq: int, dv: int, chunk: int, device: torch.device) -> bool:
    """Whether both GEMMs of softmax_chunks (as it lays them out) give each token's rows the same
    bits in a block of `tokens` tokens as in one of TOKENS tokens, on random operands, in batches
    of 3 and 1."""
    gen = torch.Generator().manual_seed(0)
    m = tokens * rows
    for k, n, keys_major in ((dq, chunk, True), (chunk, dv, False)):
        a = torch.randn(3, TOKENS * rows, k, generator=gen).to(device)
        w = torch.randn(3, n, k, generator=gen).to(device).transpose(1, 2) if keys_major else \
            torch.randn(3, k, n, generator=gen).to(device)
        ref = bmm(a, w)
        for r in range(0, TOKENS * rows, m):
            part = slice(r, r + m)
            if not (torch.equal(bmm(a[:, part].contiguous(), w), ref[:, part])
                    and torch.equal(bmm(a[:1, part].contiguous(), w[:1]), ref[:1, part])):
                return False
    return True


def attend_blocks(q: torch.Tensor, blocks: tuple[torch.Tensor, ...], page_table: torch.Tensor, kv_pool: KVPool,
                  layer: int, n_splits: int = 1,
                  scratch: tuple[torch.Tensor, torch.Tensor] | None = None,
                  cos_sin_cache: torch.Tensor | None = None) -> torch.Tensor:
    """attend by the CUDA kernel over `blocks` (Plan.blocks' form, in any order: each block is
    one program that reads only its own entries and writes only its own real rows); n_splits > 1:
    split-KV (decode blocks only) with `scratch` (split_scratch), the same bits; with
    `cos_sin_cache` q is the QKV projection [T, Hq + 2 Hkv, D] before RoPE and the K/V store
    (triton_ops.invariant_attention)."""
    from engine.layers import triton_ops

    ps = kv_pool.page_size
    q = q if cos_sin_cache is not None else q.contiguous()
    return triton_ops.invariant_attention(q, kv_pool.k[layer], kv_pool.v[layer], ps, page_table, blocks,
                                          kv_chunk(ps), kv_part(ps), n_splits, scratch, cos_sin_cache)


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
