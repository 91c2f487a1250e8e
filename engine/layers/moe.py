"""Mixture-of-experts block: router, fused routed experts, optional shared experts.

Contract (what a model builds on; Qwen3-MoE, GLM-4.5 and DeepSeek-V2/V3 use it as is):

    moe = MoE(hidden_size, spec, dtype)     # spec: any object with the `MoESpec` attributes
    y = moe(x)                              # x [T, hidden] -> [T, hidden], x.dtype, all-reduced

`MoE` is the whole `mlp` of an MoE layer; its submodules carry the HF checkpoint names, so that
`model.layers.{L}.mlp.` + the names below load through models/loader.py:

* `gate` (`Router`): `weight` [E, hidden] and, for noaux_tc routing, `e_score_correction_bias`
  [E] (float32). Replicated on every rank. The weight and the logits are float32 where
  transformers computes them so (DeepSeek, GLM: spec.router_float32), else in the model's
  dtype (Qwen MoE's nn.Linear gate; then the float32 softmax, as there).
* `experts` (`Experts`): `w13` [E, 2 * I_local, hidden] (gate rows then up rows: HF's
  `experts.{e}.gate_proj` / `up_proj`) and `w2` [E, hidden, I_local] (`experts.{e}.down_proj`).
  Tensor parallelism gives each rank a slice of every expert's intermediate dim (I_local of
  `range_split(I, world, rank)`, uneven where it does not divide): w13 column-parallel, w2
  row-parallel, like the dense MLP. Both carry a `Sharding` (along dim 1 / 2) and `experts_of`
  says they are stacked over experts, so the loader fills expert e's row from HF's per-expert
  tensors (`loader.ExpertShard`).
* `shared_experts` (`SharedMLP`, when spec.num_shared_experts > 0): a dense SwiGLU MLP of
  intermediate `intermediate_size * num_shared_experts` (`gate_up_proj`, `down_proj`).

Routing (`route`), as transformers computes it (logits = x @ gate.weight^T, taken to float32):
* scores = softmax(logits) (Qwen3-MoE, DeepSeek-V2) or sigmoid(logits) (DeepSeek-V3, GLM-4.5);
* topk_method "greedy": the top_k scores; "group_limited_greedy" (V2): experts in n_group
  groups, a group scored by its best expert, only the topk_group best groups take part;
  "noaux_tc" (V3): choice = scores + e_score_correction_bias, a group scored by the sum of its
  two best choices, top_k of the choices in the topk_group best groups;
* weights = the chosen experts' scores (not the biased choices), divided by their sum when
  norm_topk_prob, times routed_scaling_factor. Slots are sorted by choice, best first, the
  lowest expert index first among equal choices (bf16 logits tie), on every path.

Compute (`Experts.forward`): the T*k (token, slot) pairs are sorted by expert (a stable argsort
of the flat top-k ids); for each expert with tokens one gate_up GEMM, SiLU-and-mul, one down
GEMM over its rows (`parallel.matmul`: in fixed row blocks under deterministic inference, so a
row's result does not depend on how many other rows the expert got); the outputs go back to
their (token, slot) place, and a token's k outputs are summed in float32 in slot order (not in
scatter order): out = sum_j w[t, j] * y[t, j]. With the shared experts' partial product added,
one all-reduce per block at tp > 1. Plain torch ops on the CPU (they read the per-expert counts
on the host). On CUDA the fused triton kernels of engine/layers/moe_kernels.py (no host sync: an
MoE block says `supports_cuda_graph`), reading fp8 stacks as they are; under deterministic
inference with one GEMM config for every batch (`moe_kernels.DET_CONFIG`, its bits checked across
row counts on an H200), so a token's experts sum in the same order whatever else is routed.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch
from torch import nn

from engine.layers import ops, triton_ops
from engine.layers.forward import ForwardBatch
from engine.layers.kv_pool import PAD_PAGE
from engine.layers.parallel import (
    ColumnParallelLinear,
    Piece,
    RowParallelLinear,
    Sharding,
    _param,
    _row_pieces,
    _shard,
    gemv_for,
    matmul,
    parallel_state,
    range_split,
)
from engine.layers.tuning import kernel_tuning

SCORING_FUNCS = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


class MoESpec(Protocol):
    """What the layer reads of a config (models/config.py's MoEConfig has these fields)."""

    num_experts: int  # routed experts E
    top_k: int  # experts per token (num_experts_per_tok)
    intermediate_size: int  # per expert (moe_intermediate_size)
    scoring_func: str  # SCORING_FUNCS
    topk_method: str  # TOPK_METHODS
    norm_topk_prob: bool
    n_group: int  # expert groups (grouped methods); 1 = no grouping
    topk_group: int  # groups a token may pick from
    routed_scaling_factor: float
    num_shared_experts: int  # 0 = none
    router_float32: bool  # router weight and logits in float32, else in the model's dtype


class PadRows(NamedTuple):
    """A forward's padding rows: those t with keys[t] < below (a CUDA graph's rows past the batch
    write their K/V into the padding page: keys = out_slots, below = page_size). Never counted in
    `Experts.token_counts`; the fused kernels leave their pairs out (no expert weights read for
    them, zeros out), the torch path computes them like any row."""

    keys: torch.Tensor
    below: int


def pad_rows(batch: ForwardBatch) -> PadRows:
    """A forward batch's padding rows: those writing their K/V into the padding page (a CUDA
    graph's rows past the batch; an eager batch has none)."""
    assert PAD_PAGE == 0, "padding rows are told by out_slots below one page"
    return PadRows(batch.out_slots, batch.page_size)


def _experts(p: nn.Parameter, n: int, first: int = 0, total: int | None = None) -> None:
    """Mark `p` as a stack of experts first .. first + n - 1 (of `total`) along dim 0."""
    p.moe_experts = n  # type: ignore[attr-defined]  # read by the loader (dim 0 stacks experts)
    p.moe_expert_range = (first, n if total is None else total)  # type: ignore[attr-defined]


def experts_of(p: torch.Tensor) -> int:
    """How many experts a parameter stacks along dim 0 (0: not an expert stack)."""
    return getattr(p, "moe_experts", 0)


def expert_range(p: torch.Tensor) -> tuple[int, int]:
    """(the first expert a stack holds, the model's experts): (0, E) but on an expert-parallel rank."""
    return getattr(p, "moe_expert_range", (0, experts_of(p)))


def copy_experts_mark(src: torch.Tensor, dst: nn.Parameter) -> None:
    """Give `dst` the expert-stack mark of `src` (a stack re-made quantized or plain)."""
    first, total = expert_range(src)
    _experts(dst, experts_of(src), first, total)


def is_grouped(spec: MoESpec) -> bool:
    """Whether routing first keeps the topk_group best of n_group expert groups (else every group
    takes part: Qwen3-MoE, GLM-4.5 with n_group 1)."""
    return spec.topk_method != "greedy" and spec.topk_group < spec.n_group


def route(logits: torch.Tensor, spec: MoESpec, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, k], expert ids int64 [T, k]) from router logits [T, E] (any float
    dtype, taken to float32 first)."""
    logits = logits.float()
    # sigmoid as 1 / (1 + exp(-x)): torch's CPU sigmoid gives other bits in its vector body than
    # in its scalar tail, whose place moves with the row count; exp, add and divide do not
    scores = logits.softmax(-1) if spec.scoring_func == "softmax" else logits.neg().exp_().add_(1).reciprocal_()
    choice = scores if bias is None else scores + bias
    if is_grouped(spec):
        grouped = choice.view(-1, spec.n_group, spec.num_experts // spec.n_group)
        if spec.topk_method == "noaux_tc":
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        else:
            group_scores = grouped.amax(-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, _best(group_scores, spec.topk_group), True)
        choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(-1, spec.num_experts)
    ids = _best(choice, spec.top_k)
    weights = scores.gather(1, ids)
    if spec.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    if spec.routed_scaling_factor != 1.0:
        weights = weights * spec.routed_scaling_factor
    return weights, ids


def _best(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest along the last dim, best first, the lowest index among equals
    (as moe_kernels' route_kernel picks; torch.topk leaves ties unspecified, and bf16 logits tie)."""
    return x.sort(dim=-1, descending=True, stable=True).indices[..., :k]


class Router(nn.Module):
    """The gate: logits of every expert (float32 or the model's dtype: spec.router_float32),
    then `route` in float32."""

    def __init__(self, hidden_size: int, spec: MoESpec, dtype: torch.dtype) -> None:
        super().__init__()
        self.spec = spec
        self.weight = _param(spec.num_experts, hidden_size, dtype=torch.float32 if spec.router_float32 else dtype)
        noaux = spec.topk_method == "noaux_tc"
        self.e_score_correction_bias = _param(spec.num_experts, dtype=torch.float32) if noaux else None
        self._gemv: tuple | None | bool = False  # a bf16 router's small-batch GEMV config; False: not decided
        self._gemv_rows = 0

    def gemv_config(self, x: torch.Tensor) -> tuple | None:
        """The router's triton GEMV config where x takes it now (decode rows, a 16-bit router), else None."""
        if self._gemv is False:  # decided once, on the weight's device (a float32 router keeps cuBLAS)
            self._gemv = triton_ops.gemv_config(self.weight)
            self._gemv_rows = kernel_tuning(self.weight.device).gemv_rows(self._gemv)
        return gemv_for(self._gemv, self._gemv_rows, self.weight.shape[1], x)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.weight.dtype)
        cfg = self.gemv_config(x)
        # decode: the projections' triton GEMV (cuBLAS's M=1 GEMM took 4.9 us a layer for
        # Qwen3-30B-A3B's 128 x 2048); else the batch-invariant matmul under deterministic inference
        return triton_ops.gemv(x, self.weight, *cfg) if cfg is not None else matmul(x, self.weight)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.route(self.logits(x))

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, ids) of the experts from the router's logits."""
        if logits.is_cuda:  # (one program per token: batch-invariant as it is)
            from engine.layers import moe_kernels  # triton: imported on first use (CUDA)

            return moe_kernels.route(logits, self.spec, self.e_score_correction_bias)  # one launch, not 6-12
        return route(logits, self.spec, self.e_score_correction_bias)


class Experts(nn.Module):
    """The routed experts, fused: w13 [E_local, 2 * I_local, H] and w2 [E_local, H, I_local].

    Tensor parallelism: every expert (E_local = E), a slice of each one's intermediate dim.
    Expert parallelism (`parallel_state().ep`, world W > 1: the tensor-parallel ranks): whole
    experts, E / W of them per rank (first = rank * E / W), I_local = I. Every rank has every
    token (activations are replicated between the blocks), so dispatch is each rank picking
    the (token, slot) pairs routed to its experts, and the combine is the block's all-reduce of
    the partial sums (the pairs routed elsewhere contribute zeros here)."""

    def __init__(self, hidden_size: int, spec: MoESpec, dtype: torch.dtype) -> None:
        super().__init__()
        t, ep = parallel_state().tp, parallel_state().ep
        e, inter = spec.num_experts, spec.intermediate_size
        if e % ep.world:
            raise ValueError(f"--ep-size {ep.world} does not divide the model's {e} routed experts "
                             "(config.json num_experts / n_routed_experts)")
        self.num_experts, self.local_experts = e, e // ep.world
        self.first = ep.rank * self.local_experts
        mine = range_split(inter, t.world, t.rank) if ep.world == 1 else (0, inter)
        pieces, local, full = _row_pieces([("gate", inter, mine), ("up", inter, mine)])
        self.local_inter, n = mine[1] - mine[0], self.local_experts
        self.w13 = _param(n, local, hidden_size, dtype=dtype)
        _shard(self.w13, Sharding(1, (e, full, hidden_size), pieces))
        self.w2 = _param(n, hidden_size, self.local_inter, dtype=dtype)
        _shard(self.w2, Sharding(2, (e, hidden_size, inter), {None: Piece(mine, 0, inter, 0)}))
        _experts(self.w13, n, self.first, e)
        _experts(self.w2, n, self.first, e)
        self.quant: str | None = None  # fp8 stacks (engine/layers/moe_quant.py) or plain
        # routed (token, expert) pairs per expert since the last reset, on the weights' device:
        # one in-place add a forward, read by engine/run/expert_counts.py at its stats cadence
        self.register_buffer("token_counts", torch.zeros(e, dtype=torch.int64), persistent=False)

    @property
    def fused(self) -> bool:
        """Whether forward takes the fused kernels (CUDA): no host sync, capturable."""
        return self.w13.is_cuda

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                pad: PadRows | None = None) -> torch.Tensor:
        """This rank's partial sum [T, H] (x.dtype) of sum_j weights[t, j] * expert_{ids[t, j]}(x[t])."""
        if x.is_cuda:
            return self._fused(x, weights, ids, pad)
        t, k = ids.shape
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        per_expert = torch.bincount(flat, minlength=self.num_experts)
        counted = per_expert if pad is None else torch.bincount(
            flat[(pad.keys >= pad.below).repeat_interleave(k)], minlength=self.num_experts)
        self.token_counts += counted
        counts = per_expert.tolist()  # host sync on a GPU
        lo = sum(counts[: self.first])  # this rank's experts' pairs: order[lo:hi] (all of them at ep 1)
        hi = lo + sum(counts[self.first : self.first + self.local_experts])
        mine = order[lo:hi]
        xs = x.index_select(0, mine // k)
        ys = x.new_empty(hi - lo, x.shape[1])
        start = 0
        for i in range(self.local_experts):
            n = counts[self.first + i]
            if n:
                h = matmul(xs[start : start + n], self._weight("w13", i, x.dtype))
                ys[start : start + n] = matmul(ops.silu_and_mul(h), self._weight("w2", i, x.dtype))
                start += n
        y = torch.empty_like(ys) if hi - lo == t * k else x.new_zeros(t * k, x.shape[1])
        y[mine] = ys  # back to (token, slot) order: an assignment, nothing summed yet
        y = y.view(t, k, -1)
        out = y[:, 0].float() * weights[:, :1]
        for j in range(1, k):  # slot order: a token's sum never depends on the batch
            out += y[:, j].float() * weights[:, j : j + 1]  # mul, add: no FMA in one path only
        return out.to(x.dtype)

    def _fused(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, pad: PadRows | None) -> torch.Tensor:
        from engine.layers import moe_gemv  # triton: imported on first use (CUDA)
        from engine.layers import moe_kernels as mk

        w13, w2 = (mk.Stack(getattr(self, n), getattr(self, n + "_scale", None), self.quant) for n in ("w13", "w2"))
        mk.warm(x, w13, w2, ids.shape[1], self.num_experts, pad is not None)  # every config compiled before ready
        gemv = moe_gemv.config(x, w13)
        if gemv is not None:  # one token: two GEMV launches, no align or combine
            return moe_gemv.one_token_experts(x, weights, ids, w13, w2, self.token_counts, self.first, gemv)
        cfg = mk.config_for(x.device, ids.numel(), self.local_experts)
        return mk.fused_experts(x, weights, ids, w13, w2, self.token_counts, self.first, cfg, pad)

    def _weight(self, name: str, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert e's w13 or w2; a quantized stack's (GPU) dequantized on the fly."""
        if self.quant is None:
            return getattr(self, name)[e]
        from engine.layers.moe_quant import expert_weight  # that module builds on this one

        return expert_weight(self, name, e, dtype)


class SharedMLP(nn.Module):
    """The shared experts: one dense SwiGLU MLP (column-parallel gate_up, row-parallel down)."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.tp = parallel_state().tp
        mine = range_split(intermediate_size, self.tp.world, self.tp.rank)
        self.gate_up_proj = ColumnParallelLinear(
            hidden_size, [("gate", intermediate_size, mine), ("up", intermediate_size, mine)], False, dtype
        )
        self.down_proj = RowParallelLinear(intermediate_size, mine, hidden_size, False, dtype)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial output (the whole output at tp 1), before any all-reduce."""
        h = self.gate_up_proj(x)
        if self.tp.world == 1:
            return self.down_proj.forward_silu_mul(h)  # takes a CPU-packed weight too
        return self.down_proj.partial(h, silu_mul=True)


class MoE(nn.Module):
    """An MoE layer's `mlp`: x [T, H] -> [T, H] (see the module docstring for the contract)."""

    def __init__(self, hidden_size: int, spec: MoESpec, dtype: torch.dtype) -> None:
        super().__init__()
        check_spec(spec)
        self.tp = parallel_state().tp
        self.gate = Router(hidden_size, spec, dtype)
        self.experts = Experts(hidden_size, spec, dtype)
        shared = spec.num_shared_experts * spec.intermediate_size
        self.shared_experts = SharedMLP(hidden_size, shared, dtype) if shared else None

    @property
    def supports_cuda_graph(self) -> bool:
        """The fused kernels (CUDA) are capturable; the torch path reads per-expert counts on the host."""
        return self.experts.fused

    def forward(self, x: torch.Tensor, pad: PadRows | None = None) -> torch.Tensor:
        weights, ids = self.gate(x)
        y = self.experts(x, weights, ids, pad)
        if self.shared_experts is not None:
            y = y + self.shared_experts.partial(x)
        return self.tp.all_reduce(y)

    def add_norm_forward(self, x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                         eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(forward(RMSNorm(x + residual) * norm_weight), x + residual) with the add and the norm in
        the router's GEMV (triton_ops.add_norm_gemv, whose first program also stores the normalized
        row for the experts): one token on one rank, no shared experts, a router GEMV of one tile;
        else None (the caller runs the norm's own launch, then forward). The norm's launch was
        1.8 us a layer and broke the chain of PDL launches (Qwen3-30B-A3B batch 1, docs/PERF.md
        twenty-first session)."""
        if x.shape[0] != 1 or self.tp.world != 1 or self.shared_experts is not None or not residual.is_contiguous():
            return None
        cfg = self.gate.gemv_config(x)  # None on CPU: no triton GEMV there
        if cfg is None or cfg[1] < x.shape[1]:
            return None
        logits, s, h = triton_ops.add_norm_gemv(x, residual, norm_weight, eps, self.gate.weight, *cfg, h_out=True)
        return self.experts(h, *self.gate.route(logits)), s


def check_spec(spec: MoESpec) -> None:
    """ValueError naming the field for a spec the layer cannot run (models/config.py checks the
    same at parse time, with the config.json key names)."""
    e, g = spec.num_experts, spec.n_group
    checks = [
        (e > 0, f"num_experts must be > 0, got {e}"),
        (0 < spec.top_k <= e, f"num_experts_per_tok ({spec.top_k}) must be in 1..num_experts ({e})"),
        (spec.intermediate_size > 0, f"moe_intermediate_size must be > 0, got {spec.intermediate_size}"),
        (spec.scoring_func in SCORING_FUNCS, f"scoring_func {spec.scoring_func!r} not in {SCORING_FUNCS}"),
        (spec.topk_method in TOPK_METHODS, f"topk_method {spec.topk_method!r} not in {TOPK_METHODS}"),
        (g > 0 and e % g == 0, f"n_group ({g}) must divide num_experts ({e})"),
        (0 < spec.topk_group <= g, f"topk_group ({spec.topk_group}) must be in 1..n_group ({g})"),
        (spec.topk_method != "noaux_tc" or g == 0 or e // g >= 2,
         f"noaux_tc scores a group by its 2 best experts: num_experts / n_group ({e}/{g}) must be >= 2"),
        (g == 0 or spec.topk_group * (e // g) >= spec.top_k,
         f"num_experts_per_tok ({spec.top_k}) exceeds the experts of topk_group ({spec.topk_group}) groups"),
        (spec.num_shared_experts >= 0, f"n_shared_experts must be >= 0, got {spec.num_shared_experts}"),
    ]
    for ok, msg in checks:
        if not ok:
            raise ValueError(f"invalid MoE config: {msg}")
