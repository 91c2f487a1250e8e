"""Tensor-parallel (Megatron-style) layers and the process-group holder they read.

One worker process per rank; `set_tp` is called once per process (engine/run/dist.py) before
the model is built, and every layer reads the module-level `tp()` at construction. At
world 1 each layer is exactly the single-GPU layer (same parameters, same kernels: the
triton GEMVs stay); at world > 1:

* column-parallel (`ColumnParallelLinear`): a rank holds contiguous row ranges of each fused
  piece (its q heads, its K/V heads, its slice of gate and of up); no communication.
* row-parallel (`RowParallelLinear`: o_proj, down_proj): a rank holds the matching input
  columns; partial outputs are summed with one all-reduce, the bias added after it.
* `VocabParallelEmbedding`: a rank holds a vocabulary range, looks up its ids, zeros the
  rest, all-reduce. `lm_logits`: each rank's logits over its vocabulary range, gathered
  (padded to equal sizes) so every rank holds identical full logits before sampling.

Heads (`head_shard`): K/V heads are split across ranks when there are at least as many as
ranks (unevenly when they do not divide: 3 heads on 2 ranks are 2 + 1, the q heads following
their group), else q heads are split evenly and each rank keeps (a replica of) the one K/V
head its q heads read. Every sharded parameter carries a `Sharding` (which ranges of which
checkpoint tensor it holds) that the loader and the dummy initializer follow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from engine.layers import ops, triton_ops
from engine.layers.tuning import kernel_tuning


@dataclass
class TPGroup:
    """This process's place in the tensor-parallel group; world 1 means no communication."""

    rank: int = 0
    world: int = 1
    group: Any = None  # torch.distributed ProcessGroup; None = the default group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over ranks, in place; every rank gets the same bytes (one reduction per element,
        then copies), which is what lets every rank sample the same token."""
        if self.world > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_cols(self, x: torch.Tensor, total: int) -> torch.Tensor:
        """[S, local] per rank -> [S, total]: rank r's columns are range_split(total, world, r).
        Ranks with fewer columns pad, since collectives need equal sizes."""
        if self.world == 1:
            return x
        per = -(-total // self.world)
        if x.shape[1] < per:
            x = F.pad(x, (0, per - x.shape[1]))
        x = x.contiguous()
        if dist.get_backend(self.group) == "nccl":  # one buffer, one kernel (capturable in a CUDA graph)
            out = torch.empty(self.world * x.shape[0], per, dtype=x.dtype, device=x.device)
            dist.all_gather_into_tensor(out, x, group=self.group)
            parts = list(out.view(self.world, x.shape[0], per).unbind(0))
        else:  # gloo has no all_gather_into_tensor
            parts = [torch.empty_like(x) for _ in range(self.world)]
            dist.all_gather(parts, x, group=self.group)
        widths = [e - s for s, e in (range_split(total, self.world, r) for r in range(self.world))]
        return torch.cat([p[:, :w] for p, w in zip(parts, widths, strict=True)], dim=1)


_TP = TPGroup()


def tp() -> TPGroup:
    return _TP


def set_tp(rank: int, world: int, group: Any = None) -> TPGroup:
    """Set once per process, before the model is built (layers read it at construction)."""
    global _TP
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside a world of {world}")
    _TP = TPGroup(rank, world, group)
    return _TP


def range_split(n: int, parts: int, i: int) -> tuple[int, int]:
    """Part i of [0, n) cut into `parts` contiguous ranges, the first n % parts one longer."""
    base, extra = divmod(n, parts)
    start = i * base + min(i, extra)
    return start, start + base + (1 if i < extra else 0)


@dataclass(frozen=True)
class HeadShard:
    q: tuple[int, int]  # this rank's q head range
    kv: tuple[int, int]  # its K/V head range (a replica when K/V heads are fewer than ranks)

    @property
    def num_q(self) -> int:
        return self.q[1] - self.q[0]

    @property
    def num_kv(self) -> int:
        return self.kv[1] - self.kv[0]


def head_shard(num_heads: int, num_kv_heads: int, rank: int, world: int) -> HeadShard:
    group = num_heads // num_kv_heads
    if num_kv_heads >= world:  # split K/V heads (unevenly if need be); q heads follow their group
        ks, ke = range_split(num_kv_heads, world, rank)
        return HeadShard((ks * group, ke * group), (ks, ke))
    # fewer K/V heads than ranks: each rank's q heads must read one K/V head, which it replicates
    if num_heads % world or world % num_kv_heads:
        raise ValueError(
            f"tensor parallelism over {world} ranks needs num_heads ({num_heads}) divisible by it and it divisible "
            f"by num_kv_heads ({num_kv_heads}) when there are fewer K/V heads than ranks"
        )
    qs, qe = range_split(num_heads, world, rank)
    return HeadShard((qs, qe), (qs // group, qs // group + 1))


# ---- sharding descriptors (read by models/loader.py) --------------------------------------


@dataclass(frozen=True)
class Piece:
    """One checkpoint tensor's contribution to a sharded parameter, along `Sharding.dim`."""

    src: tuple[int, int]  # the range this rank reads, inside the checkpoint tensor
    dst: int  # where it lands in the local parameter
    full_len: int  # the checkpoint tensor's length along dim (checked on load)
    full_offset: int  # where the checkpoint tensor starts inside the whole, unsharded fused parameter


@dataclass(frozen=True)
class Sharding:
    dim: int
    full_shape: tuple[int, ...]  # the unsharded parameter (what world 1 holds)
    pieces: dict[str | None, Piece]  # fused shard name (q, k, v, gate, up) or None -> its piece


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def _shard(p: nn.Parameter, sharding: Sharding) -> None:
    p.tp_sharding = sharding  # type: ignore[attr-defined]  # read by the loader


def sharding_of(p: nn.Parameter) -> Sharding | None:
    """The parameter's Sharding, or None: replicated, loaded whole."""
    return getattr(p, "tp_sharding", None)


def _row_pieces(parts: list[tuple[str | None, int, tuple[int, int]]]) -> tuple[dict[str | None, Piece], int, int]:
    """(pieces, local rows, full rows) for fused parts given as (name, full length, local range)."""
    pieces, dst, off = {}, 0, 0
    for name, full, (s, e) in parts:
        pieces[name] = Piece((s, e), dst, full, off)
        dst += e - s
        off += full
    return pieces, dst, off


# ---- layers --------------------------------------------------------------------------------


class Linear(nn.Module):
    """y = x W^T (+ b), without nn.Linear's (slow, useless here) random init."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param(out_features, in_features, dtype=dtype)
        self.bias = _param(out_features, dtype=dtype) if bias else None
        self._gemv: tuple | None | bool = False  # small-batch triton GEMV config; False: not decided yet
        self._gemv_rows = 0  # most rows of x that config takes (the GPU's tuning)

    def gemv_config(self, x: torch.Tensor) -> tuple | None:
        """The triton GEMV config when x has few enough rows for it (batch-1 decode; small decode
        batches where the config holds a whole row slice per program), else None."""
        if self._gemv is False:  # decided once, on the device the weights ended up on
            # tp > 1: plain F.linear on the local shard first (the GEMVs are tuned for whole weights)
            self._gemv = triton_ops.gemv_config(self.weight) if tp().world == 1 else None
            self._gemv_rows = kernel_tuning(self.weight.device).gemv_max_rows
        rows = x.shape[0]
        if (self._gemv is None or rows > self._gemv_rows or self.bias is not None or not x.is_contiguous()
                or not ops.fused_enabled()):
            return None
        return self._gemv if triton_ops.gemv_rows_ok(self._gemv, self.weight.shape[1], rows) else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.gemv_config(x)
        if cfg is not None:  # batch-1 decode: a GEMV, not cuBLAS's M=1 GEMM
            return triton_ops.gemv(x, self.weight, *cfg)
        return F.linear(x, self.weight, self.bias)


class ColumnParallelLinear(Linear):
    """Output rows split: `parts` are the fused pieces as (name, full rows, this rank's range)."""

    def __init__(self, in_features: int, parts: list[tuple[str | None, int, tuple[int, int]]], bias: bool,
                 dtype: torch.dtype) -> None:
        pieces, local, full = _row_pieces(parts)
        super().__init__(in_features, local, bias, dtype)
        _shard(self.weight, Sharding(0, (full, in_features), pieces))
        if self.bias is not None:
            _shard(self.bias, Sharding(0, (full,), pieces))


class RowParallelLinear(Linear):
    """Input columns split (this rank's range of `in_features`); outputs summed over ranks."""

    def __init__(self, in_features: int, in_range: tuple[int, int], out_features: int, bias: bool,
                 dtype: torch.dtype) -> None:
        super().__init__(in_range[1] - in_range[0], out_features, bias, dtype)
        self.tp = tp()
        _shard(self.weight, Sharding(1, (out_features, in_features), {None: Piece(in_range, 0, in_features, 0)}))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.world == 1:
            return super().forward(x)
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias  # once, not once per rank


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split by vocabulary range; also the tied LM head's weight."""

    def __init__(self, num: int, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.tp = tp()
        self.num = num
        self.start, self.end = range_split(num, self.tp.world, self.tp.rank)
        self.weight = _param(self.end - self.start, dim, dtype=dtype)
        _shard(self.weight, Sharding(0, (num, dim), {None: Piece((self.start, self.end), 0, num, 0)}))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world == 1:
            return F.embedding(ids, self.weight)
        mine = (ids >= self.start) & (ids < self.end)
        out = F.embedding(torch.where(mine, ids - self.start, 0), self.weight)
        return self.tp.all_reduce(out * mine.unsqueeze(-1).to(out.dtype))


class ParallelLMHead(nn.Module):
    """An untied LM head: rows split by vocabulary range like the embedding."""

    def __init__(self, hidden: int, vocab: int, dtype: torch.dtype) -> None:
        super().__init__()
        start, end = range_split(vocab, tp().world, tp().rank)
        self.weight = _param(end - start, hidden, dtype=dtype)
        _shard(self.weight, Sharding(0, (vocab, hidden), {None: Piece((start, end), 0, vocab, 0)}))


def lm_logits(h: torch.Tensor, weight: torch.Tensor, vocab: int) -> torch.Tensor:
    """float32 logits [S, vocab] from the final hidden rows and this rank's LM-head rows; at
    world > 1 gathered, so that every rank holds the same full logits."""
    t = tp()
    if t.world == 1:
        return F.linear(h, weight).float()
    if h.shape[0] == 0:  # nothing sampled this step: same on every rank, so no collective is skipped by one
        return h.new_zeros(0, vocab, dtype=torch.float32)
    return t.all_gather_cols(F.linear(h, weight), vocab).float()  # gathered in the model dtype: half the bytes
