"""Tensor-parallel (Megatron-style) layers and the process-group holder they read.

One worker process per rank; `set_parallel_state` is called once per process (engine/run/dist.py)
before the model is built, and every layer reads `parallel_state().tp` at construction. At
world 1 each layer is exactly the single-GPU layer (same parameters, same kernels: the
triton GEMVs stay); at world > 1:

* column-parallel (`ColumnParallelLinear`): a rank holds contiguous row ranges of each fused
  piece (its q heads, its K/V heads, its slice of gate and of up); no communication.
* row-parallel (`RowParallelLinear`: o_proj, down_proj): a rank holds the matching input
  columns; partial outputs are summed with one all-reduce, the bias added after it.
* small batches run the same triton GEMVs as world 1 on the local shard: the GPU's tuning rules
  are looked up with the shard's [N, K] (Llama-3.1-8B at tp 2: QKV 3072x4096, o_proj 4096x2048,
  gate_up 14336x4096, down 4096x7168); a shape no rule takes stays on the vendor kernel.
* all-reduce: NCCL, or for messages up to the tuning's `tp_symm_allreduce_max_bytes` (bf16 and
  fp32 on CUDA) a one-shot all-reduce over peer memory (`SymmAllReduce`, torch symmetric memory:
  the input copied into a registered buffer, then one kernel that meets the peers at a barrier
  and sums every rank's buffer in rank order; capturable in a CUDA graph). Every rank gets the
  same bytes either way.
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

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from engine.layers import batch_invariant, invariant_gemv, ops, triton_ops
from engine.layers.cpu_gemm import cpu_pack, packed_linear
from engine.layers.shards import HeadShard, head_shard, range_split  # noqa: F401 - re-exported for the layers
from engine.layers.tuning import kernel_tuning


@dataclass
class TPGroup:
    """This process's place in the tensor-parallel group; world 1 means no communication."""

    rank: int = 0
    world: int = 1
    group: Any = None  # torch.distributed ProcessGroup; None = the default group
    # the small-message path, or None: SymmAllReduce (CUDA, set up before capture) or ShmAllReduce
    # (CPU ranks of one host, engine/layers/shm_allreduce.py)
    symm: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over ranks: the returned tensor (x itself, reduced in place, on the NCCL/gloo
        path; a new one on the one-shot path). Every rank gets the same bytes (each element summed
        once in one order, then copied), which is what lets every rank sample the same token."""
        if self.world > 1:
            if self.symm is not None and self.symm.takes(x):
                return self.symm.all_reduce(x)
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


class SymmAllReduce:
    """One-shot all-reduce over peer memory for small messages (torch symmetric memory, CUDA).

    One registered buffer per dtype (bf16, fp32) of `max_bytes`, mapped into every rank's
    address space at set-up (a collective: every rank constructs it at the same point, before
    any CUDA graph is captured). A call is two kernels: x is copied into this rank's buffer,
    then `symm_mem.one_shot_all_reduce_out` meets the peers at a barrier, reads every rank's
    buffer and sums in rank order 0..W-1 (so every rank gets the same bytes), and meets them
    again (no rank overwrites its buffer while a peer still reads it); the output is a fresh
    tensor. No host work beyond the launches, so it is captured in CUDA graphs like any kernel.

    Not torch's `one_shot_all_reduce_copy_out`, which copies inside the kernel (one launch
    fewer): its copy is not followed by a block barrier before the signal that releases the
    buffer to the peers (torch's own "pattern 1" wants one), so a peer could read an element
    that another warp has not stored yet. NVLink multicast is not used (the multimem ops need
    it; TORCH_SYMM_MEM_DISABLE_MULTICAST=1 stays set)."""

    DTYPES = (torch.bfloat16, torch.float32)  # the dtypes torch's one-shot kernel dispatches

    def __init__(self, group: Any, max_bytes: int, device: torch.device) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.max_bytes = max_bytes - max_bytes % 16
        if self.max_bytes <= 0:
            raise ValueError(f"SymmAllReduce: max_bytes {max_bytes} holds no message")
        group = group if group is not None else dist.group.WORLD
        self.group_name = group.group_name
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)  # needed before torch 2.10, deprecated after
        if enable is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                enable(self.group_name)
        self.bufs: dict[torch.dtype, torch.Tensor] = {}
        self.handles = []
        for dtype in self.DTYPES:
            buf = symm_mem.empty(self.max_bytes // dtype.itemsize, dtype=dtype, device=device)
            self.handles.append(symm_mem.rendezvous(buf, group))  # collective: maps every rank's buffer
            self.bufs[dtype] = buf
        self._out = torch.ops.symm_mem.one_shot_all_reduce_out

    def takes(self, x: torch.Tensor) -> bool:
        """Whether x goes this way: CUDA, bf16/fp32, contiguous, 1..max_bytes bytes, a multiple
        of 4 bytes (the kernel's narrowest vector)."""
        n = x.numel() * x.element_size()
        return x.is_cuda and x.dtype in self.bufs and 0 < n <= self.max_bytes and n % 4 == 0 and x.is_contiguous()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        buf = self.bufs[x.dtype][: x.numel()]  # exactly x's size: the kernel reduces buf.numel() elements
        buf.copy_(x.view(-1))
        out = torch.empty_like(x)
        self._out(buf, "sum", self.group_name, out.view(-1))
        return out


def symm_all_reduce_ok(max_bytes: int, device: torch.device) -> bool:
    """Whether the one-shot path may be set up here: a CUDA device, a threshold, torch's ops."""
    if device.type != "cuda" or max_bytes <= 0:
        return False
    try:
        import torch.distributed._symmetric_memory  # noqa: F401

        return hasattr(torch.ops.symm_mem, "one_shot_all_reduce_out")
    except Exception:  # noqa: BLE001 - a torch without symmetric memory: NCCL only
        return False


@dataclass(frozen=True)
class ParallelState:
    """This rank's process groups, one per kind of parallelism (each a `TPGroup`: rank, world,
    process group, collectives). Set once per process (engine/run/dist.py) before the model is
    built; layers read `parallel_state().tp` (or `.ep`) at construction. Every group has world 1
    until its flag exists: ep (experts), cp (context), dp (data: attention replicas)."""

    tp: TPGroup = field(default_factory=TPGroup)
    ep: TPGroup = field(default_factory=TPGroup)
    cp: TPGroup = field(default_factory=TPGroup)
    dp: TPGroup = field(default_factory=TPGroup)

    def __post_init__(self) -> None:
        for name in ("tp", "ep", "cp", "dp"):
            g = getattr(self, name)
            if not 0 <= g.rank < g.world:
                raise ValueError(f"{name} group: rank {g.rank} outside a world of {g.world}")


_STATE = ParallelState()


def parallel_state() -> ParallelState:
    return _STATE


def set_parallel_state(state: ParallelState) -> ParallelState:
    """Set once per process, before the model is built (layers read it at construction);
    tests set it per simulated rank."""
    global _STATE
    _STATE = state
    return state


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


def gemv_for(cfg: tuple | None, max_rows: int, k: int, x: torch.Tensor) -> tuple | None:
    """cfg (a weight's triton GEMV config over K = k, taking up to max_rows rows: decided once
    per weight) when x takes the small-batch GEMV now, else None: few enough contiguous rows,
    fused kernels on, and not deterministic inference (whose GEMMs are the batch-invariant ones)."""
    rows = x.shape[0]
    if cfg is None or rows > max_rows or not x.is_contiguous() or not ops.fused_enabled() or batch_invariant.enabled():
        return None
    return cfg if triton_ops.gemv_rows_ok(cfg, k, rows) else None


class Linear(nn.Module):
    """y = x W^T (+ b), without nn.Linear's (slow, useless here) random init."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param(out_features, in_features, dtype=dtype)
        self.bias = _param(out_features, dtype=dtype) if bias else None
        self._gemv: tuple | None | bool = False  # small-batch triton GEMV config; False: not decided yet
        self._gemv_rows = 0  # most rows of x that config takes (the GPU's tuning)
        self.packed: torch.Tensor | None = None  # CPU: the weight in oneDNN's blocked layout (pack_for_cpu)
        self.quant: str | None = None  # a quantized weight format (engine/layers/quant.py), CUDA only
        # deterministic inference's folded RMSNorm (models/llama.py fold_norms): the norm's weight is in
        # self.weight and the invariant GEMM scales each row by rsqrt(mean(x^2) + norm_eps)
        self.norm_eps: float | None = None

    def _local_gemv(self, x: torch.Tensor) -> tuple | None:
        """The triton GEMV config for x times this layer's local weight (bias aside), or None."""
        if self._gemv is False:  # decided once, on the device the weights ended up on
            # the local weight's [N, K]: a tensor-parallel shard is looked up by its own shape, and a
            # shape no tuning rule takes (or a GPU without rules) keeps the vendor kernel
            # quantized: only fp8 with row scales has a GEMV (weight-only, scaled per row)
            self._gemv = triton_ops.gemv_config(self.weight) if self.quant in (None, "fp8_row") else None
            self._gemv_rows = kernel_tuning(self.weight.device).gemv_rows(self._gemv)
        return gemv_for(self._gemv, self._gemv_rows, self.weight.shape[1], x)

    def gemv_config(self, x: torch.Tensor) -> tuple | None:
        """The triton GEMV config when x has few enough rows for it (batch-1 decode; small decode
        batches where the config holds a whole row slice per program), else None. A caller that
        runs the GEMV itself gets the whole layer's output from it (no bias, no communication);
        never for a quantized weight, whose scales only this layer applies."""
        return None if self.bias is not None or self.quant is not None else self._local_gemv(x)

    def gemv_weights(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, tuple] | None:
        """(weight, fp8 row scales or None, GEMV config) when x takes this layer's triton GEMV and
        that GEMV is the whole layer (no bias, no communication), for a caller that runs it with
        more work folded in (models/llama.py: linear_add_norm)."""
        if self.bias is not None or self.quant not in (None, "fp8_row") or self.packed is not None:
            return None
        cfg = self._local_gemv(x)
        return None if cfg is None else (self.weight, getattr(self, "weight_scale", None), cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm_eps is not None:
            from engine.layers import invariant_gemm

            return invariant_gemm.gemm(x, self.weight, norm_eps=self.norm_eps)
        if self.quant is not None:
            y = self.quant_forward(self, x, self._local_gemv(x))
            return y if self.bias is None else y + self.bias
        cfg = self.gemv_config(x) if self.packed is None else None
        if cfg is not None:  # batch-1 decode: a GEMV, not cuBLAS's M=1 GEMM
            return triton_ops.gemv(x, self.weight, *cfg)
        return matmul(x, self.weight, self.bias, self.packed)

    def forward_act(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up of this [gate | up] layer's output (bias-free) in one launch where
        deterministic inference's CUDA GEMV takes x (1-8 rows, invariant_gemm.gemm_act: the bits
        of this layer then ops.silu_and_mul's flashinfer kernel), else None."""
        if (not batch_invariant.enabled() or x.dim() != 2 or x.shape[0] > invariant_gemv.MAX_ROWS
                or self.bias is not None or self.quant is not None or self.packed is not None
                or not ops.fused_ok(x) or not _invariant_gemm_fits(x, self.weight)):
            return None
        from engine.layers import invariant_gemm

        return invariant_gemm.gemm_act(x, self.weight, norm_eps=self.norm_eps)

    def forward_silu_mul(self, h: torch.Tensor) -> torch.Tensor:
        """self(silu(gate) * up) for h = [gate | up] ([T, 2 * in_features]): for small batches
        the activation is folded into the GEMV (one launch fewer)."""
        if self.quant is not None:
            return self.quant_forward(self, h, self._local_gemv(h), silu_mul=True)
        cfg = self.gemv_config(h)
        if cfg is not None:
            return triton_ops.gemv(h, self.weight, *cfg, silu_mul=True)
        return self(ops.silu_and_mul(h))


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
        self.tp = parallel_state().tp
        _shard(self.weight, Sharding(1, (out_features, in_features), {None: Piece(in_range, 0, in_features, 0)}))
        self.adds_residual = False  # its layer's norms folded: the forward_add GEMM runs (fold_norms)

    def gemv_config(self, x: torch.Tensor) -> tuple | None:
        # at world > 1 a GEMV run by the caller would be this rank's partial sum only (no
        # all-reduce): callers get None and call forward / forward_silu_mul, which GEMV the shard
        return super().gemv_config(x) if self.tp.world == 1 else None

    def gemv_weights(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, tuple] | None:
        return super().gemv_weights(x) if self.tp.world == 1 else None

    def partial(self, x: torch.Tensor, silu_mul: bool = False) -> torch.Tensor:
        """This rank's partial product x W_local^T (no bias), silu(gate) * up first with silu_mul:
        the shard's GEMV for small batches, else the vendor kernel."""
        if self.quant is not None:
            return self.quant_forward(self, x, self._local_gemv(x), silu_mul=silu_mul)
        cfg = self._local_gemv(x)
        if cfg is not None:
            return triton_ops.gemv(x, self.weight, *cfg, silu_mul=silu_mul)
        return matmul(ops.silu_and_mul(x) if silu_mul else x, self.weight)

    def _reduce(self, y: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias  # once, not once per rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.world == 1:
            return super().forward(x)
        return self._reduce(self.partial(x))

    def forward_silu_mul(self, h: torch.Tensor) -> torch.Tensor:
        if self.tp.world == 1:
            return super().forward_silu_mul(h)
        return self._reduce(self.partial(h, silu_mul=True))

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + self(x), the sum rounded once more, by the invariant GEMM's epilogue (deterministic
        inference's folded norms, models/llama.py fold_norms: one rank, no bias)."""
        from engine.layers import invariant_gemm

        return invariant_gemm.gemm(x, self.weight, residual=residual)


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split by vocabulary range; also the tied LM head's weight."""

    def __init__(self, num: int, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.tp = parallel_state().tp
        self.num = num
        self.start, self.end = range_split(num, self.tp.world, self.tp.rank)
        self.weight = _param(self.end - self.start, dim, dtype=dtype)
        _shard(self.weight, Sharding(0, (num, dim), {None: Piece((self.start, self.end), 0, num, 0)}))
        self.packed: torch.Tensor | None = None  # CPU, tied LM head: the weight in oneDNN's layout

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
        t = parallel_state().tp
        start, end = range_split(vocab, t.world, t.rank)
        self.weight = _param(end - start, hidden, dtype=dtype)
        _shard(self.weight, Sharding(0, (vocab, hidden), {None: Piece((start, end), 0, vocab, 0)}))
        self.packed: torch.Tensor | None = None  # CPU: the weight in oneDNN's layout


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b) by the vendor kernel (oneDNN's packed weight where there is one: bias-free
    layers only). With deterministic inference: on CUDA one batch-invariant triton GEMM
    (engine/layers/invariant_gemm.py), elsewhere the vendor kernel in fixed row blocks
    (batch_invariant.rows_of)."""
    def gemm(a: torch.Tensor) -> torch.Tensor:
        return F.linear(a, weight, bias) if packed is None else packed_linear(a, packed)

    if not batch_invariant.enabled():
        return gemm(x)
    if x.is_cuda and x.dim() == 2 and _invariant_gemm_fits(x, weight):  # one launch, any row count
        from engine.layers import invariant_gemm

        return invariant_gemm.gemm(x, weight, bias)
    key = ("packed" if packed is not None else "plain", bias is not None, *weight.shape, x.dtype)
    return batch_invariant.rows_of(x, gemm, key)


def _invariant_gemm_fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether engine/layers/invariant_gemm.py takes this product (CUDA, triton, a plain
    half/float weight of x's dtype); else cuBLAS in fixed row blocks."""
    return x.dtype == w.dtype and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and triton_ops.available()


def pack_for_cpu(model: nn.Module) -> int:
    """Every one-rank, bias-free projection and the LM head of a CPU model in oneDNN's layout
    (`cpu_pack`); how many were packed. A packed projection or untied head drops its plain
    weight (nothing else multiplies with it; one copy of the weights, not two): the parameter
    becomes a meta tensor, the same shape, dtype and bytes for whoever counts them, and an
    error, not garbage, for any code that would still compute with it. The embedding keeps its
    plain weight (the lookup reads it), packed as well when it is the tied LM head."""
    if parallel_state().tp.world != 1:
        return 0
    mods = list(model.modules())
    untied = [m for m in mods if isinstance(m, ParallelLMHead)]
    heads = untied or [m for m in mods if isinstance(m, VocabParallelEmbedding)]
    n = 0
    for m in [m for m in mods if isinstance(m, Linear) and m.bias is None] + heads:
        m.packed = cpu_pack(m.weight)
        if m.packed is None:
            continue
        n += 1
        if not isinstance(m, VocabParallelEmbedding):
            m.weight = nn.Parameter(m.weight.detach().to("meta"), requires_grad=False)
        if isinstance(m, Linear):
            m._gemv = None  # decided: no triton GEMV (it would read the plain weight)
    return n


def lm_logits(h: torch.Tensor, weight: torch.Tensor, vocab: int, packed: torch.Tensor | None = None) -> torch.Tensor:
    """float32 logits [S, vocab] from the final hidden rows and this rank's LM-head rows
    (`packed`: the same in oneDNN's layout, on CPU); at world > 1 gathered, so that every rank
    holds the same full logits."""
    t = parallel_state().tp
    local = matmul(h, weight, packed=packed if t.world == 1 else None)
    if t.world == 1:
        return local.float()
    if h.shape[0] == 0:  # nothing sampled this step: same on every rank, so no collective is skipped by one
        return h.new_zeros(0, vocab, dtype=torch.float32)
    return t.all_gather_cols(local, vocab).float()  # gathered in the model dtype: half the bytes
