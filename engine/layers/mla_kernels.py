"""Paged MLA decode attention in triton: the absorbed form over the latent pool (CUDA; the tests
run it in triton's CPU interpreter). Imported only where triton is (mla_attention.py imports it
on first use on a CUDA device).

One decode row b with absorbed queries q_lat [H, R] (q_nope through W_UK) and roped q_pe [H, P]
attends its L cached latents [c | k_pe] (R + P values a token: 512 + 64 for DeepSeek-V3) read
through its page table: scores = (q_lat . c + q_pe . k_pe) * scale, output softmax . c [H, R]
(fp32 accumulation, in q's dtype). W_UV is applied by the caller.

Split-KV (flash-decoding) in two launches:
* `_mla_split_kernel`, grid (head blocks, B, MAX_SPLITS): program (hb, b, s) attends BLOCK_H heads
  of row b over split s of its tokens, in tiles of BLOCK_N tokens with an online softmax (fp32),
  and writes its normalized partial output (in q's dtype, as flashinfer's split-KV decode keeps
  its partials: half the bytes of fp32 at no more than the output's own rounding) and its
  log2-sum-exp (fp32). Splits past the row's end exit.
* `_mla_reduce_kernel`, grid (H, B): merges a row's splits in split order.

The split length is a function of the row's own length and the head count only (at least
`min_split(H)` tokens, at most MAX_SPLITS splits a row, a multiple of MIN_SPLIT_TOKENS), never of
the batch: a row's output is the same bits whatever else is in the batch (tested), and the grid
depends on B only, so a CUDA graph keeps one grid per batch size. `min_split` grows with the head
count because each split writes H x R partials (and H LSEs): at 128 heads (DeepSeek-V3 at tp 1)
a split of 512 tokens reads 0.59 MB of latents and writes 0.13 MB of bf16 partials. Shorter splits
would help a small batch (more programs) and cost a large one (partials past the L2): the bench's
sweep times `MLAKernelConfig.min_split` against it.

The pool's dtype: bf16/fp16/fp32, or fp8 e4m3 stored unscaled (as KVPool stores it), read as
bytes and widened to q's dtype in the kernel. R and P of any size: the tiles pad them to a power
of two >= 16 (tl.dot's K) with masked columns. A tile's loads are pipelined (num_stages 3: one
tile in flight during another's math; `scripts/mla_aot.py` shows it in the sm_90a code, with
the shared memory that `MLAKernelConfig.shared_bytes` predicts).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.layers.triton_ops import interpreted

MAX_SPLITS = 16  # splits of one row at most (the grid's third axis)
MAX_ROWS = 65535  # rows a launch takes (the grid's second axis: CUDA's limit); more go in several
# bytes of split partials a launch may allocate (2 MB a row at 128 heads): a deterministic prefill of
# 8 x 1024 tokens of DeepSeek-V3 asked 17 GB in one launch (and overflowed int32 offsets: an illegal
# address on the H200), so its rows go 512 at a time
PARTIAL_BYTES = 1 << 30
MIN_SPLIT_TOKENS = 256  # split lengths are multiples of this (so every BLOCK_N <= 256 divides them)
HOPPER_SHARED = 232_448  # shared memory bytes a block may take on sm_90 (227 KiB, opted into)


@dataclass(frozen=True)
class MLAKernelConfig:
    """Tile shape, launch options and split length of the split kernel. They change the order of
    a row's sums, so they are fixed per model, never chosen per batch."""

    block_h: int = 16  # query heads a program takes (a tensor-core tile's rows)
    block_n: int = 32  # tokens per tile
    num_warps: int = 4
    # 3: triton's pipeliner issues a tile's copies at the end of the iteration two tiles ahead and
    # waits with one tile still in flight; at 2 it issues the next tile's copies after this tile's
    # math and the next iteration starts by waiting for them (no overlap of load and math: the
    # first H200 run's ~3.4 us a 32-token tile). Bits do not depend on it.
    num_stages: int = 3
    min_split: int = 0  # tokens a split covers at least (a multiple of MIN_SPLIT_TOKENS); 0: min_split(H)
    v_split: int = 0  # programs a (row, head block, split) shares its output columns over; 0: v_split()

    def __post_init__(self) -> None:
        pow2 = lambda n: n >= 1 and not n & (n - 1)  # noqa: E731 - triton's tile dims
        for name in ("block_h", "block_n", "num_warps"):
            if not pow2(getattr(self, name)):
                raise ValueError(f"MLAKernelConfig.{name} must be a power of two, got {getattr(self, name)}")
        if not 16 <= self.block_n <= MIN_SPLIT_TOKENS:  # tl.dot's K (the p @ v product); divides a split
            raise ValueError(f"MLAKernelConfig.block_n must be in [16, {MIN_SPLIT_TOKENS}], got {self.block_n}")
        if self.num_stages < 1:
            raise ValueError(f"MLAKernelConfig.num_stages must be >= 1, got {self.num_stages}")
        if self.min_split < 0 or self.min_split % MIN_SPLIT_TOKENS:
            raise ValueError(f"MLAKernelConfig.min_split must be 0 or a multiple of {MIN_SPLIT_TOKENS}, "
                             f"got {self.min_split}")
        if self.v_split and not pow2(self.v_split):
            raise ValueError(f"MLAKernelConfig.v_split must be 0 or a power of two, got {self.v_split}")

    def shared_bytes(self, rank: int = 512, rope: int = 64, itemsize: int = 2, v_split: int = 0) -> int:
        """Shared memory the split kernel takes (triton 3.9, sm_90a, a 16-bit pool) at `v_split`
        (0: the config's, else 1): buffers of a tile's latents (BLOCK_N x (R + P)) and, with
        v_split > 1, of its value columns (BLOCK_N x R / v_split), plus the queries (BLOCK_H x (R +
        P)). Warpgroup MMA tiles (64+ heads, whole warpgroups) keep num_stages buffers; mma.sync
        tiles num_stages - 1 and a BLOCK_H x BLOCK_N scratch for the probabilities. To the byte
        what the compiler asks for (scripts/mla_aot.py) at (64, 32, 8, 2|3), (64, 64, 8, 2),
        (16|32, 32|64, 4|8, 2|3) and v_split 1, 2, 4; 253,952 for (64, 64, 8, 2) at v_split 4 was
        the first H200 run's OutOfResources."""
        rb, pb = padded(rank), padded(rope)
        v = v_split or self.v_split or 1
        cols = rb + pb + (rb // v if v > 1 else 0)
        queries = self.block_h * (rb + pb)
        if self.block_h >= 64 and self.num_warps % 4 == 0:  # wgmma
            return (self.num_stages * self.block_n * cols + queries) * itemsize
        return ((self.num_stages - 1) * self.block_n * cols + queries + self.block_h * self.block_n) * itemsize


DEFAULT_CONFIG = MLAKernelConfig()
# 64 heads a program: Hopper's warpgroup MMA (wgmma needs 64 rows; 16 and 32 take mma.sync) and a
# latent tile read once for 64 heads, not 8 times for 16. What triton 3.9 + ptxas 13.4 give for
# sm_90a on a bf16 pool (scripts/mla_aot.py, no GPU needed): v_split 4: 174 registers, no spills,
# 204 KiB shared memory; v_split 1: 255 registers, 188 bytes of spills, 180 KiB (one program an
# SM); v_split 2 would take 228 KiB (over Hopper's 227), so the batch gets 1 instead
# (`fitting_v_split`). (16, 32, 4, 3): 210 registers, no spills, 91 KiB at v_split 1.
WIDE_CONFIG = MLAKernelConfig(block_h=64, block_n=32, num_warps=8, num_stages=3)


def default_config(heads: int) -> MLAKernelConfig:
    """The tile config for a model with `heads` query heads a rank (fixed per model: a row's bits
    must not depend on anything but the row). Many heads (V3 at tp 1: 128) are compute bound:
    the wgmma tile; few (tp 8: 16) are memory bound and would leave most of its rows empty."""
    return WIDE_CONFIG if heads >= 64 else DEFAULT_CONFIG


def v_split(batch: int, head_blocks: int, rank: int) -> int:
    """Programs that share a (row, head block, split)'s output columns, each computing the same
    scores and summing 1/v of the columns: parallelism for a small batch (batch 1 at 128 heads has
    2 head blocks x a few splits) that leaves every output's bits as they are (the same scores,
    each column summed over the same tiles in the same order), so it may follow the batch size.
    At least 64 columns a program."""
    n = batch * head_blocks
    v = 4 if n < 32 else 2 if n < 64 else 1
    while v > 1 and rank // v < 64:
        v //= 2
    return v


def fitting_v_split(v: int, config: MLAKernelConfig, rank: int, rope: int, itemsize: int, limit: int) -> int:
    """`v` halved until the config's shared memory at it fits `limit` bytes (a v_split > 1 stages
    its value columns beside the latents): any v gives the same bits, so the fit may choose it."""
    while v > 1 and config.shared_bytes(rank, rope, itemsize, v_split=v) > limit:
        v //= 2
    return v


@functools.cache
def _shared_limit(device: torch.device) -> int:
    """Shared memory bytes a block may opt into on `device` (Hopper's on the CPU interpreter)."""
    if device.type != "cuda":
        return HOPPER_SHARED
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "shared_memory_per_block_optin", HOPPER_SHARED))


def min_split(heads: int) -> int:
    """Fewest tokens a split covers by default: a split's bf16 partial outputs (heads x R x 2
    bytes, 0.9 x heads tokens' worth of latents at R = 512) stay <= ~1/4 of the latents it reads."""
    n = MIN_SPLIT_TOKENS
    while n < 4 * heads:
        n *= 2
    return n


def split_len(length: int, heads: int, lo: int = 0) -> int:
    """Tokens per split of a row of `length` (the kernel's formula, for tests and the bench);
    `lo`: the config's min_split (0: min_split(heads))."""
    lo = lo or min_split(heads)
    per = -(-length // MAX_SPLITS)
    return max(lo, -(-per // lo) * lo)


def padded(n: int) -> int:
    """A latent dim as the kernel's tiles take it: a power of two (triton's arange), >= 16
    (tl.dot's K); the padding columns are masked."""
    return max(16, triton.next_power_of_2(n))


@triton.jit
def _cols(d, N: tl.constexpr, NB: tl.constexpr):
    """The columns `d` (of 0..NB-1) that are real, < N: a constant all-true mask where nothing is
    padded (so the loads' vector width is that of unmasked columns)."""
    if N == NB:
        return tl.full(d.shape, 1, tl.int1)
    else:
        return d < N


# the table's row stride is the step's widest page count in eager steps: not specialized on, so
# that no eager step after warm-up compiles a variant of its own
@triton.jit(do_not_specialize=["stride_tb"])
def _mla_split_kernel(
    q, q_pe, kv, table, table_rows, lens, part_o, part_lse, sm_scale,
    stride_qb, stride_qh, stride_pb, stride_ph, stride_kv, stride_tb, H,
    R: tl.constexpr, P: tl.constexpr, RB: tl.constexpr, PB: tl.constexpr, PAGE: tl.constexpr,
    MIN_SPLIT: tl.constexpr, SPLITS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    KV_FP8: tl.constexpr, DOT_F32: tl.constexpr, IEEE: tl.constexpr, VSPLIT: tl.constexpr,
    HAS_ROWS: tl.constexpr,
):
    hb = tl.program_id(0) // VSPLIT
    vs = tl.program_id(0) % VSPLIT  # which 1/VSPLIT of the output columns this program sums
    b = tl.program_id(1).to(tl.int64)  # partial offsets pass 2^31 at 128 heads from 2,048 rows
    s = tl.program_id(2)
    length = tl.load(lens + b)
    per = tl.cdiv(length, SPLITS)
    split = tl.maximum(MIN_SPLIT, tl.cdiv(per, MIN_SPLIT) * MIN_SPLIT)
    start = s * split
    if start < length:
        end = tl.minimum(start + split, length)
        heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        hmask = heads < H
        # RB, PB: R and P padded to a power of two >= 16 (tl.dot's K); the padding columns load as
        # zeros, so they add nothing to the scores and are not stored
        dr = tl.arange(0, RB)
        dp = tl.arange(0, PB)
        DV: tl.constexpr = RB // VSPLIT
        dv = vs * DV + tl.arange(0, DV)
        rmask = _cols(dr, R, RB)
        pmask = _cols(dp, P, PB)
        vmask = _cols(dv, R, RB)
        qv = tl.load(q + b * stride_qb + heads[:, None] * stride_qh + dr[None, :],
                     mask=hmask[:, None] & rmask[None, :], other=0.0)
        pv = tl.load(q_pe + b * stride_pb + heads[:, None] * stride_ph + dp[None, :],
                     mask=hmask[:, None] & pmask[None, :], other=0.0)
        act = qv.dtype
        if DOT_F32:
            qv = qv.to(tl.float32)
            pv = pv.to(tl.float32)
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        den = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, DV], tl.float32)
        qk_scale = sm_scale * 1.4426950408889634  # exp2 domain
        if HAS_ROWS:  # several rows (a request's new tokens) read one table row
            row_table = table + tl.load(table_rows + b).to(tl.int64) * stride_tb
        else:
            row_table = table + b * stride_tb
        offs = start + tl.arange(0, BLOCK_N)
        page = tl.load(row_table + offs // PAGE, mask=offs < end, other=0)
        for n0 in range(start, end, BLOCK_N):
            offs = n0 + tl.arange(0, BLOCK_N)
            nmask = offs < end
            slot = (page.to(tl.int64) * PAGE + offs % PAGE) * stride_kv
            # every load of the tile issued before any math: one memory round trip a tile, not
            # three (the page index, then the latents, then the value columns after the scores)
            c = tl.load(kv + slot[:, None] + dr[None, :], mask=nmask[:, None] & rmask[None, :], other=0)
            kp = tl.load(kv + slot[:, None] + R + dp[None, :], mask=nmask[:, None] & pmask[None, :], other=0)
            if VSPLIT == 1:
                cv = c
            else:  # this program's columns of the tile again (from L1/L2): the same values as c's
                cv = tl.load(kv + slot[:, None] + dv[None, :], mask=nmask[:, None] & vmask[None, :], other=0)
            nxt = offs + BLOCK_N  # the next tile's page indices, in flight during this tile's math
            page = tl.load(row_table + nxt // PAGE, mask=nxt < end, other=0)
            if KV_FP8:  # unscaled e4m3 bytes, widened to q's dtype
                c = c.to(tl.float8e4nv, bitcast=True).to(act)
                kp = kp.to(tl.float8e4nv, bitcast=True).to(act)
                if VSPLIT == 1:
                    cv = c
                else:
                    cv = cv.to(tl.float8e4nv, bitcast=True).to(act)
            if DOT_F32:
                c = c.to(tl.float32)
                kp = kp.to(tl.float32)
                cv = cv.to(tl.float32)
            if IEEE:
                sc = tl.dot(qv, tl.trans(c), input_precision="ieee")
                sc += tl.dot(pv, tl.trans(kp), input_precision="ieee")
            else:
                sc = tl.dot(qv, tl.trans(c))
                sc += tl.dot(pv, tl.trans(kp))
            sc = tl.where(nmask[None, :], sc * qk_scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(sc, 1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(sc - m_new[:, None])
            den = den * alpha + tl.sum(p, 1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(cv.dtype), cv, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(cv.dtype), cv)
            m = m_new
        base = (b * SPLITS + s) * H + heads
        o = (acc / den[:, None]).to(part_o.dtype.element_ty)
        tl.store(part_o + base[:, None] * R + dv[None, :], o, mask=hmask[:, None] & vmask[None, :])
        first = (tl.zeros([BLOCK_H], tl.int32) + vs) == 0  # one program of the VSPLIT writes the LSE
        tl.store(part_lse + base, m + tl.log2(den), mask=hmask & first)


@triton.jit
def _mla_reduce_kernel(
    part_o, part_lse, lens, out, stride_ob, stride_oh, H,
    R: tl.constexpr, RB: tl.constexpr, MIN_SPLIT: tl.constexpr, SPLITS: tl.constexpr,
):
    h = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    length = tl.load(lens + b)
    per = tl.cdiv(length, SPLITS)
    split = tl.maximum(MIN_SPLIT, tl.cdiv(per, MIN_SPLIT) * MIN_SPLIT)
    n = tl.cdiv(length, split)
    si = tl.arange(0, SPLITS)
    smask = si < n
    base = (b * SPLITS + si) * H + h
    lse = tl.load(part_lse + base, mask=smask, other=float("-inf"))
    w = tl.where(smask, tl.exp2(lse - tl.max(lse, 0)), 0.0)
    w = w / tl.sum(w, 0)
    dr = tl.arange(0, RB)
    rmask = _cols(dr, R, RB)
    o = tl.load(part_o + base[:, None] * R + dr[None, :], mask=smask[:, None] & rmask[None, :],
                other=0.0).to(tl.float32)
    res = tl.sum(o * w[:, None], 0)
    tl.store(out + b * stride_ob + h * stride_oh + dr, res.to(out.dtype.element_ty), mask=rmask)


def _check(q_lat: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, table: torch.Tensor,
           rows: torch.Tensor | None, lens: torch.Tensor) -> None:
    b, h, r = q_lat.shape
    if q_pe.shape[:2] != (b, h) or latent.shape[-1] != r + q_pe.shape[2]:
        raise ValueError(f"q_lat {tuple(q_lat.shape)} and q_pe {tuple(q_pe.shape)} do not match the latent "
                         f"{tuple(latent.shape)}")
    if latent.stride(-1) != 1:
        raise ValueError("the latent pool needs a contiguous last dim")
    if table.dtype != torch.int32 or lens.dtype != torch.int32 or lens.shape != (b,):
        raise ValueError(f"page table int32 [B, W] and lengths int32 [B] expected for B={b}")
    if (table.shape[0] != b) if rows is None else (rows.dtype != torch.int32 or rows.shape != (b,)):
        raise ValueError(f"a table row per row, or table_rows int32 [B] naming one, expected for B={b}")
    if r < 1 or q_pe.shape[2] < 1:
        raise ValueError(f"latent dims must be >= 1, got {r} + {q_pe.shape[2]}")


def launch_rows(heads: int, rank: int, itemsize: int) -> int:
    """Rows one launch takes: CUDA's grid limit, and at most PARTIAL_BYTES of split partials."""
    return max(1, min(MAX_ROWS, PARTIAL_BYTES // (MAX_SPLITS * heads * (rank * itemsize + 4))))


def mla_decode(
    q_lat: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, page_table: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, page_size: int, config: MLAKernelConfig | None = None,
    table_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Absorbed MLA decode: q_lat [B, H, R] and q_pe [B, H, P] (q's dtype) attend each row's
    seq_lens[b] (int32 [B], >= 1) latents of `latent` (one layer's pool, [slots, 1, R + P] or
    [slots, R + P], bf16/fp16/fp32 or fp8 e4m3) through page_table (int32 [B, W]; slot = page *
    page_size + offset), row b through table row table_rows[b] where given (int32 [B]: a prefill's
    tokens, each a row over its causal prefix, share their request's). Returns o_lat [B, H, R] in
    q's dtype (W_UV not applied)."""
    _check(q_lat, q_pe, latent, page_table, table_rows, seq_lens)
    step = launch_rows(q_lat.shape[1], q_lat.shape[2], q_lat.element_size())
    if q_lat.shape[0] > step:  # (a deterministic prefill's tokens: rows are independent)
        return torch.cat([
            mla_decode(q_lat[i : i + step], q_pe[i : i + step], latent,
                       page_table if table_rows is not None else page_table[i : i + step],
                       seq_lens[i : i + step], scale, page_size, config,
                       None if table_rows is None else table_rows[i : i + step])
            for i in range(0, q_lat.shape[0], step)])
    q_lat = q_lat if q_lat.stride(-1) == 1 else q_lat.contiguous()
    q_pe = q_pe if q_pe.stride(-1) == 1 else q_pe.contiguous()
    b, h, r = q_lat.shape
    p = q_pe.shape[2]
    kv = latent.reshape(latent.shape[0], r + p)
    fp8 = kv.dtype == torch.float8_e4m3fn
    if fp8:
        kv = kv.view(torch.uint8)
    out = torch.empty(b, h, r, dtype=q_lat.dtype, device=q_lat.device)
    if b == 0:
        return out
    part_o = torch.empty(b, MAX_SPLITS, h, r, dtype=q_lat.dtype, device=q_lat.device)
    part_lse = torch.empty(b, MAX_SPLITS, h, dtype=torch.float32, device=q_lat.device)
    f32 = q_lat.dtype == torch.float32
    cfg = config or default_config(h)
    lo = cfg.min_split or min_split(h)
    blocks = triton.cdiv(h, cfg.block_h)
    rb, pb = padded(r), padded(p)
    limit = _shared_limit(q_lat.device)
    # a v_split that does not fit the device's shared memory is halved, a config's own too (the
    # first H200 run: (64, 32, 8, 3) asks 233,472 bytes at v_split 2, 1 KB over Hopper's limit)
    # (rows through table_rows, a deterministic prefill: one v_split, so the warm-up's prefill
    # compiles the only variant and no later step of a few rows compiles another)
    v = cfg.v_split or (1 if table_rows is not None else v_split(b, blocks, r))
    vsplit = fitting_v_split(v, cfg, r, p, q_lat.element_size(), limit)
    if rb % vsplit:
        raise ValueError(f"v_split {vsplit} does not divide the padded latent rank {rb}")
    _mla_split_kernel[(blocks * vsplit, b, MAX_SPLITS)](
        q_lat, q_pe, kv, page_table, table_rows if table_rows is not None else seq_lens, seq_lens, part_o, part_lse,
        float(scale),
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), kv.stride(0), page_table.stride(0), h,
        R=r, P=p, RB=rb, PB=pb, PAGE=page_size, MIN_SPLIT=lo, SPLITS=MAX_SPLITS, BLOCK_H=cfg.block_h,
        BLOCK_N=cfg.block_n,
        KV_FP8=fp8, DOT_F32=interpreted() and not f32, IEEE=f32 and not interpreted(), VSPLIT=vsplit,
        HAS_ROWS=table_rows is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    _mla_reduce_kernel[(h, b)](
        part_o, part_lse, seq_lens, out, out.stride(0), out.stride(1), h,
        R=r, RB=rb, MIN_SPLIT=lo, SPLITS=MAX_SPLITS, num_warps=4,
    )
    return out
