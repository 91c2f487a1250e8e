"""Llama-family decoder (Llama 2/3/3.1, Mistral, Qwen2, Qwen3, SmolLM) over paged KV.

GQA, RoPE (optionally llama3-scaled), RMSNorm, SwiGLU; Qwen3's per-head q/k RMSNorm and
Qwen2's q/k/v bias are config flags. Each layer has one fused qkv_proj and one fused
gate_up_proj; models/loader.py maps HF's separate q/k/v and gate/up tensors into them.
Parameters are allocated uninitialised (torch.empty) on the current default device: a
loader fills every one of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from engine.layers import ops, quant, triton_ops
from engine.layers.attention import AttentionBackend
from engine.layers.context import ForwardContext
from engine.layers.forward import ForwardBatch
from engine.layers.kv_layout import KVLayout
from engine.layers.kv_pool import KVPool
from engine.layers.ops import apply_rope, rope_cos_sin  # noqa: F401 - re-exported (moved to ops)
from engine.layers.parallel import (
    ColumnParallelLinear,
    Linear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    _param,
    head_shard,
    lm_logits,
    parallel_state,
    range_split,
)
from engine.layers.triton_ops import PreNormed
from engine.layers.tuning import kernel_tuning
from models.config import ModelConfig, RopeScaling, YarnScaling

_HALF = (torch.float16, torch.bfloat16)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, cast back before the weight (as HF Llama does)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param(dim, dtype=dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); may reuse x and residual's storage (fused)."""
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


def rope_frequencies(dim: int, theta: float, scaling: RopeScaling | YarnScaling | None) -> tuple[torch.Tensor, float]:
    """(float32 [dim/2] inverse frequencies, the factor cos and sin are scaled by): plain, Llama-3.1's
    smoothing, or YaRN (Qwen's long-context recipe, DeepSeek-V3's MLA), as transformers computes each."""
    if isinstance(scaling, YarnScaling):
        return yarn_inv_freq(dim, theta, scaling)
    return rope_inv_freq(dim, theta, scaling), 1.0


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """float32 [head_dim/2] inverse frequencies, with Llama-3.1 smoothing when `scaling` is set."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv
    old_ctx = scaling.original_max_position_embeddings
    low_wavelen = old_ctx / scaling.low_freq_factor
    high_wavelen = old_ctx / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    smooth = (old_ctx / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def mscale(scale: float, m: float = 1.0) -> float:
    """YaRN's attention scale for a context `scale` times the original (transformers' get_mscale)."""
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def yarn_inv_freq(dim: int, theta: float, y: YarnScaling) -> tuple[torch.Tensor, float]:
    """(float32 [dim/2] inverse frequencies, cos/sin factor) of YaRN, as transformers'
    _compute_yarn_parameters: per dimension a ramp between the extrapolated (original) and the
    interpolated (/ factor) frequency, from the beta_fast/beta_slow rotation counts."""
    attention_factor = y.attention_factor
    if attention_factor is None:
        if y.mscale and y.mscale_all_dim:
            attention_factor = mscale(y.factor, y.mscale) / mscale(y.factor, y.mscale_all_dim)
        else:
            attention_factor = mscale(y.factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(y.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(y.beta_fast), correction_dim(y.beta_slow)
    if y.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv = (1.0 / (y.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, float(attention_factor)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_id = layer_id
        # this rank's heads (all of them at tp 1): column-parallel QKV, row-parallel o_proj
        t = parallel_state().tp
        heads = head_shard(cfg.num_heads, cfg.num_kv_heads, t.rank, t.world)
        d = cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = heads.num_q, heads.num_kv, d
        self.q_size, self.kv_size = heads.num_q * d, heads.num_kv * d
        (qs, qe), (ks, ke) = heads.q, heads.kv
        parts = [("q", cfg.q_size, (qs * d, qe * d)), ("k", cfg.kv_size, (ks * d, ke * d)),
                 ("v", cfg.kv_size, (ks * d, ke * d))]
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, parts, cfg.attention_bias, dtype)
        self.o_proj = RowParallelLinear(cfg.q_size, (qs * d, qe * d), cfg.hidden_size, cfg.o_proj_bias, dtype)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None

    def forward(self, qkv: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Attention output (after o_proj) from this layer's fused QKV projection."""
        return self.o_proj(self.attend(qkv, ctx))

    def attend(self, qkv: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Attention output before o_proj ([T, heads * head_dim]) from the fused QKV projection."""
        t = qkv.shape[0]
        rope, batch, kv, backend = ctx.rope, ctx.batch, ctx.kv, ctx.backend
        if rope.fused and rope.prologue and not backend.owns_kv_writes:  # one kernel: q/k norm, RoPE, K/V store
            qn, kn = self.q_norm, self.k_norm
            norm = (qn.weight, kn.weight, qn.eps) if qn is not None and kn is not None else (None, None, 0.0)
            # the backend's decode kernel may take the prologue too (one launch for all of attention)
            o = backend.attend_qkv(qkv, self.layer_id, batch, kv, rope.positions, rope.cos_sin_cache, *norm)
            if o is None:
                q = triton_ops.qk_norm_rope_store(
                    qkv, self.num_heads, self.num_kv_heads, self.head_dim, rope.positions, rope.cos_sin_cache,
                    batch.out_slots, kv.k[self.layer_id], kv.v[self.layer_id], *norm,
                )
                o = backend.attend(q, self.layer_id, batch, kv)
            return o.reshape(t, self.q_size)
        if not rope.fused and self.q_norm is None and qkv.device.type == "cpu":
            # q and k rotated together, in place by the C kernel (the torch ops cost more than their bytes)
            q, k = ctx.rotary.apply_qkv(qkv, self.num_heads, self.num_kv_heads, rope)
            v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
            o = backend.forward(q, k, v, self.layer_id, batch, kv)
            return o.reshape(t, self.q_size)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # Qwen3: per-head norm before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = ctx.rotary.apply(q, k, rope)
        o = backend.forward(q, k, v, self.layer_id, batch, kv)
        return o.reshape(t, self.q_size)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        inter = cfg.intermediate_size
        t = parallel_state().tp
        mine = range_split(inter, t.world, t.rank)  # this rank's slice of the intermediate dim
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [("gate", inter, mine), ("up", inter, mine)],
                                                 False, dtype)
        self.down_proj = RowParallelLinear(inter, mine, cfg.hidden_size, False, dtype)

    def down(self, h: torch.Tensor | Activated) -> torch.Tensor:
        """The down projection of the gate_up output h ([B, 2 * intermediate]): silu(gate) * up,
        then down_proj (for small batches folded into its GEMV, on each shard at tp > 1); of an
        Activated h, down_proj alone."""
        if isinstance(h, Activated):
            return self.down_proj(h.act)
        return self.down_proj.forward_silu_mul(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.gate_up_proj(x))


@dataclass(frozen=True)
class Activated:
    """silu(gate) * up [B, intermediate], computed by the gate_up projection's own launch
    (Linear.forward_act): the down projection takes it as it is."""

    act: torch.Tensor


def norm_linear(
    norm: RMSNorm, linear: Linear, x: torch.Tensor | PreNormed, residual: torch.Tensor | None, act: bool = False,
) -> tuple[torch.Tensor | Activated, torch.Tensor]:
    """(linear(norm(x + residual)), x + residual); residual None means x is the residual stream
    itself (layer 0). For a few rows (small decode batches) one triton launch does the add, the
    norm and the GEMV; x a PreNormed (linear_add_norm): the add and half the norm are done; for
    an fp8 row-scaled linear from 17 rows the norm's launch also quantizes (quant.norm_forward).
    `act` (linear a SwiGLU gate_up): an Activated where the projection applies the activation
    itself (deterministic inference's GEMV at 1-8 rows)."""
    if isinstance(x, PreNormed):  # linear_add_norm checked that this linear runs the GEMV
        spec = linear.gemv_weights(x.u)
        assert spec is not None and residual is not None
        w, scale, cfg = spec
        return triton_ops.gemv(x, w, *cfg, scale=scale), residual
    if quant.token_quantized(linear, x) and (residual is None or residual.is_contiguous()):
        return quant.norm_forward(linear, x, residual, norm.weight, norm.eps)
    # folded only for models up to the tuning's norm_gemv_max_hidden: on an H200 at hidden 4096
    # every program re-reading the vector from L2 cost more than the launch it saves (Llama-3.1-8B
    # batch 1: 4.76 vs 4.52 ms; Qwen3-0.6B, hidden 1024: 1.31 vs 1.40)
    fold = x.shape[1] <= kernel_tuning(x.device).norm_gemv_max_hidden
    cfg = linear.gemv_config(x) if fold else None
    if cfg is not None and (residual is None or residual.is_contiguous()):
        return triton_ops.add_norm_gemv(x, residual, norm.weight, norm.eps, linear.weight, *cfg)
    h, residual = (norm(x), x) if residual is None else norm.add_forward(x, residual)
    if act and (a := linear.forward_act(h)) is not None:
        return Activated(a), residual
    return linear(h), residual


def residual_stream(x: torch.Tensor | PreNormed | None, residual: torch.Tensor) -> torch.Tensor:
    """The residual stream after a layer that returned (x, residual): their sum, or the residual
    itself where x is a PreNormed (its GEMV added into the residual in place) or None (a folded
    layer's: its down projection added it)."""
    return residual if x is None or isinstance(x, PreNormed) else x + residual


def linear_add_norm(
    linear: Linear, x: torch.Tensor | Activated, residual: torch.Tensor, norm: RMSNorm, reader: Linear,
    silu_mul: bool = False,
) -> tuple[torch.Tensor | PreNormed, torch.Tensor]:
    """(linear(x), residual), or with silu_mul linear(silu(gate) * up): the caller then adds and
    normalizes (norm_linear). Where `linear` and `reader` (the one reader of norm's output) both
    run the triton GEMV (batch-1 decode, tp 1), linear's GEMV also adds the residual in place and
    does half of the norm: (PreNormed, residual), one launch fewer (triton_ops.PreNormed; H200,
    Llama-3.1-8B batch 1: bf16 4.32 -> 4.20 ms, fp8 weights 2.73 -> 2.66, docs/PERF.md)."""
    if isinstance(x, Activated):  # silu_mul done by the gate_up launch
        return linear(x.act), residual
    # one row only: at 2-4 rows (one-tile GEMVs) norm_linear's fold measured faster (Qwen3-0.6B
    # batch 4 1.33 vs 1.42 ms; the H200 tuning file's _norm_gemv)
    mine = linear.gemv_weights(x) if x.shape[0] == 1 else None
    if mine is None or reader.gemv_weights(x) is None or not residual.is_contiguous():
        return (linear.forward_silu_mul(x) if silu_mul else linear(x)), residual
    w, scale, cfg = mine
    return triton_ops.gemv(x, w, *cfg, silu_mul=silu_mul, scale=scale,
                           norm_out=(residual, norm.weight, norm.eps)), residual


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_id, dtype)
        self.mlp = self.make_mlp(cfg, layer_id, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        # the next layer's (input norm, qkv_proj) where its forward starts with norm_linear over
        # them (LlamaForCausalLM sets it): this layer's down GEMV may do half that norm. A tuple,
        # so that nn.Module does not register the next layer's modules as this one's
        self.next_input: tuple[RMSNorm, Linear] | None = None
        self.folded = False  # its norms folded into its GEMMs (fold_norms)

    def make_mlp(self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype) -> nn.Module:
        """This layer's MLP; a subclass picks per layer (models/moe.py: MoE blocks)."""
        return MLP(cfg, dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual stream h = residual + x (x: the previous sublayer's output; residual None at
        layer 0, where x is the embedding). Returns (this layer's MLP output, its residual); folded:
        (None, the residual stream after the layer)."""
        if self.folded:
            return None, self.forward_folded(x if residual is None else residual, ctx)
        qkv, residual = norm_linear(self.input_layernorm, self.self_attn.qkv_proj, x, residual)
        o = self.self_attn.attend(qkv, ctx)
        post, gate_up = self.post_attention_layernorm, self.mlp.gate_up_proj
        x, residual = linear_add_norm(self.self_attn.o_proj, o, residual, post, gate_up)
        h, residual = norm_linear(post, gate_up, x, residual, act=True)
        if self.next_input is None:
            return self.mlp.down(h), residual
        return linear_add_norm(self.mlp.down_proj, h, residual, *self.next_input, silu_mul=True)

    def forward_folded(self, r: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The residual stream after this layer from the one before it, the norms folded (fold_norms):
        qkv and gate_up normalize their rows in their epilogues, o_proj and down add the residual in
        theirs; four GEMM launches and attention, no norm or add launch."""
        attn, mlp = self.self_attn, self.mlp
        r = attn.o_proj.forward_add(attn.attend(attn.qkv_proj(r), ctx), r)
        a = mlp.gate_up_proj.forward_act(r)  # 1-8 rows: the activation in the GEMV's epilogue
        return mlp.down_proj.forward_add(ops.silu_and_mul(mlp.gate_up_proj(r)) if a is None else a, r)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, layer_cls: type[DecoderLayer] = DecoderLayer) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.layers = nn.ModuleList(layer_cls(cfg, i, dtype) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        for layer, nxt in zip(self.layers, self.layers[1:], strict=False):
            layer.next_input = (nxt.input_layernorm, nxt.self_attn.qkv_proj)


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM. `forward` returns float32 logits [S, vocab] for batch.logit_indices."""

    layer_cls: type[DecoderLayer] = DecoderLayer  # a subclass's decoder layer (models/moe.py)
    norm_folded = False  # fold_norms folded every layer's norms (an arithmetic of its own: the L3 fingerprint)

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = cfg
        self.dtype = dtype
        self.model = LlamaModel(cfg, dtype, self.layer_cls)
        self.lm_head = None if cfg.tie_word_embeddings else ParallelLMHead(cfg.hidden_size, cfg.vocab_size, dtype)
        # a plain attribute, not a buffer: module.to(dtype) must not cast RoPE frequencies
        inv_freq, factor = rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.rotary = ops.Rotary(inv_freq, cfg.head_dim, cfg.max_position_embeddings, factor)

    @staticmethod
    def kv_layout(cfg: ModelConfig) -> KVLayout:
        """K and V per KV head (of `cfg`: a rank's shard at tp > 1)."""
        return KVLayout.gqa(cfg.num_kv_heads, cfg.head_dim)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVPool, backend: AttentionBackend) -> torch.Tensor:
        x = self.model.embed_tokens(batch.input_ids)
        ctx = ForwardContext(batch, kv, backend, self.rotary, self.rotary.prepare(batch.positions, x.dtype))
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, ctx)
        # the final norm is per token: select the sampled rows first
        idx = batch.logit_indices
        if idx.numel() == 0:  # a prefill chunk that samples no row (flashinfer's norm fails on 0 rows)
            return residual.new_empty(0, self.config.vocab_size)  # x is None where folded
        h = self.model.norm(residual[idx] if x is None else residual[idx] + x[idx])
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        return lm_logits(h, head.weight, self.config.vocab_size, head.packed)  # tp > 1: gathered on every rank


def fold_norms(model: nn.Module) -> bool:
    """Deterministic inference, where the GPU's tuning says so (`det_norm_fold_max_hidden`): every layer's two
    RMSNorms folded into the GEMMs around them (DecoderLayer.forward_folded; docs/architecture.md,
    "Norms folded"). The norm's weight is multiplied into the columns of the projection that reads it
    (qkv_proj, gate_up_proj; once, here, rounded to bf16), which scales each row of its product by
    rsqrt(mean(x^2) + eps) before rounding; o_proj and down_proj add the residual in their epilogues.
    The arithmetic differs from the unfolded one in its roundings only, and is the same at every row
    count (invariant_gemm's epilogues, the CUDA GEMV's). Every layer or none: a dense bf16 Llama-family
    model on one rank, no projection bias, no quantized weight; returns whether it folded."""
    from engine.layers import batch_invariant, invariant_gemv

    if not isinstance(model, LlamaForCausalLM) or type(model).forward is not LlamaForCausalLM.forward:
        return False
    layers = list(model.model.layers)
    w = layers[0].self_attn.qkv_proj.weight if layers else None
    if (w is None or not batch_invariant.enabled() or not w.is_cuda or w.dtype != torch.bfloat16
            or parallel_state().tp.world != 1 or not triton_ops.available()):
        return False
    tuning = kernel_tuning(w.device)
    if not (model.config.hidden_size <= tuning.det_norm_fold_max_hidden and tuning.invariant_gemv_cuda
            and invariant_gemv.library(invariant_gemv.arch(w.device)) is not None):
        return False
    for layer in layers:
        if type(layer) is not DecoderLayer or type(layer.mlp) is not MLP:
            return False
        linears = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        if any(li.bias is not None or li.quant is not None or li.weight.dtype != torch.bfloat16 for li in linears):
            return False
    fold_layers(model)
    return True


def fold_layers(model: LlamaForCausalLM) -> None:
    """fold_norms' folding, unconditionally (its tests run it on a CPU, the GEMMs interpreted)."""
    for layer in model.model.layers:
        _fold(layer.input_layernorm, layer.self_attn.qkv_proj)
        _fold(layer.post_attention_layernorm, layer.mlp.gate_up_proj)
        layer.self_attn.o_proj.adds_residual = layer.mlp.down_proj.adds_residual = True
        layer.folded = True
    model.norm_folded = True


@torch.no_grad()
def _fold(norm: RMSNorm, linear: Linear, rows: int = 4096) -> None:
    """linear's weight times norm's in each column, rounded to the weight's dtype (in row blocks: no
    float32 copy of a whole weight); the linear then normalizes its rows itself."""
    w, g = linear.weight, norm.weight.float()
    for i in range(0, w.shape[0], rows):
        w[i : i + rows] = (w[i : i + rows].float() * g).to(w.dtype)
    linear.norm_eps = norm.eps
