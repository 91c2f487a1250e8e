"""DeepSeek-V3 (and Kimi-K2, the same architecture): multi-head latent attention over a latent
KV cache, YaRN rope, dense SwiGLU MLPs in the first `first_k_dense_replace` layers and MoE
blocks (engine/layers/moe.py: sigmoid grouped top-k with the score-correction bias, shared
experts) after them.

Attention (transformers' DeepseekV3Attention, names as in the checkpoint):
  q = q_b_proj(q_a_layernorm(q_a_proj(x)))   (or q_proj(x) when q_lora_rank is null)
  [c | k_pe] = kv_a_proj_with_mqa(x);  c = kv_a_layernorm(c)
  q_pe, k_pe rotated (YaRN; rope dims interleaved in pairs when the config's rope_interleave)
  K_h = [W_UK_h c | k_pe], V_h = W_UV_h c  with kv_b_proj = [W_UK; W_UV] per head
  out = o_proj(softmax(q K^T * scale) V), scale = qk_head_dim^-0.5 * mscale(factor, mscale_all_dim)^2
The KV pool holds [c | k_pe] per token and layer (`kv_layout`: one latent of kv_lora_rank +
qk_rope_head_dim values); engine/layers/mla_attention.py attends it in the expanded form for
prefill and in the absorbed form for decode.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.attention import AttentionBackend
from engine.layers.cp_attention import ContextParallelAttention
from engine.layers.forward import ForwardBatch
from engine.layers.kv_layout import KVLayout
from engine.layers.kv_pool import KVPool
from engine.layers.mla_attention import MLABackend, MLAPlan, MLAShapes, mla_attend
from engine.layers.mla_cp import mla_attend_cp
from engine.layers.moe import MoE, pad_rows
from engine.layers.parallel import (
    ColumnParallelLinear,
    Linear,
    ParallelLMHead,
    RowParallelLinear,
    Sharding,
    VocabParallelEmbedding,
    _param,
    _row_pieces,
    _shard,
    lm_logits,
    parallel_state,
    range_split,
)
from models.config import ModelConfig, YarnScaling
from models.llama import MLP, RMSNorm, mscale, norm_linear, rope_frequencies


def softmax_scale(cfg: ModelConfig) -> float:
    assert cfg.mla is not None
    scale = cfg.mla.qk_head_dim**-0.5
    y = cfg.rope_scaling
    if isinstance(y, YarnScaling) and y.mscale_all_dim:  # transformers' yarn_apply_mscale
        scale *= mscale(y.factor, y.mscale_all_dim) ** 2
    return scale


class LatentRope:
    """RoPE of the rope part of q and the shared k_pe: cos/sin per forward (float32, times YaRN's
    attention factor), rotate-half after taking the (even, odd) pairs apart when interleaved
    (transformers' apply_rotary_pos_emb_interleave: the output is in rotate-half order)."""

    def __init__(self, cfg: ModelConfig) -> None:
        assert cfg.mla is not None
        dim, s = cfg.mla.qk_rope_head_dim, cfg.rope_scaling
        self.inv_freq, self.factor = rope_frequencies(dim, cfg.rope_theta, s)
        self.interleave = cfg.mla.rope_interleave
        self._on: dict[torch.device, torch.Tensor] = {}  # inv_freq per device: no copy inside a CUDA graph

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv = self._on.get(positions.device)
        if inv is None:
            inv = self._on[positions.device] = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * inv[None, :]  # [T, dim/2]
        return (freqs.cos() * self.factor).to(dtype), (freqs.sin() * self.factor).to(dtype)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, H, dim] -> rotated (a new tensor)."""
        if self.interleave:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            half = x.shape[-1] // 2
            x1, x2 = x[..., :half], x[..., half:]
        c, s = cos[:, None, :], sin[:, None, :]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


class MatrixWeight(nn.Module):
    """A column-parallel weight used only as matrices (MLA's kv_b_proj: W_UK and W_UV, absorbed
    into q and the output or expanding the latents), never as x W^T: not a Linear, so the CPU's
    oneDNN packing, which drops a Linear's plain weight, leaves it alone."""

    def __init__(self, in_features: int, parts: list[tuple[str | None, int, tuple[int, int]]],
                 dtype: torch.dtype) -> None:
        super().__init__()
        pieces, local, full = _row_pieces(parts)
        self.weight = _param(local, in_features, dtype=dtype)
        _shard(self.weight, Sharding(0, (full, in_features), pieces))


class MLAttention(nn.Module):
    """One layer's MLA; this rank's query heads (all of them at tp 1): q_b_proj, kv_b_proj
    column-parallel by head, o_proj row-parallel; the latent projections are replicated."""

    def __init__(self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype) -> None:
        super().__init__()
        m = cfg.mla
        assert m is not None
        t = parallel_state().tp
        hs, he = range_split(cfg.num_heads, t.world, t.rank)
        self.layer_id, self.heads = layer_id, he - hs
        qk, v, r = m.qk_head_dim, m.v_head_dim, m.kv_lora_rank
        self.shapes = MLAShapes(self.heads, r, m.qk_nope_head_dim, m.qk_rope_head_dim, v, softmax_scale(cfg))
        eps = cfg.rms_norm_eps
        self.q_lora = m.q_lora_rank is not None
        if m.q_lora_rank is None:
            # named qkv_proj, piece "q": the loader maps a checkpoint's q_proj there (models/loader.py)
            self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, [("q", cfg.num_heads * qk, (hs * qk, he * qk))],
                                                 False, dtype)
        else:
            self.q_a_proj = Linear(cfg.hidden_size, m.q_lora_rank, cfg.attention_bias, dtype)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, eps, dtype)
            self.q_b_proj = ColumnParallelLinear(m.q_lora_rank, [(None, cfg.num_heads * qk, (hs * qk, he * qk))],
                                                 False, dtype)
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, m.latent_dim, cfg.attention_bias, dtype)
        self.kv_a_layernorm = RMSNorm(r, eps, dtype)
        per_head = m.qk_nope_head_dim + v
        self.kv_b_proj = MatrixWeight(r, [(None, cfg.num_heads * per_head, (hs * per_head, he * per_head))], dtype)
        self.o_proj = RowParallelLinear(cfg.num_heads * v, (hs * v, he * v), cfg.hidden_size, cfg.attention_bias,
                                        dtype)

    def forward(self, x: torch.Tensor, ctx: MLAContext) -> torch.Tensor:
        s, t = self.shapes, x.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.qkv_proj(x)
        q = q.view(t, s.heads, s.qk_nope + s.rope)
        q_nope, q_pe = q[..., : s.qk_nope], ctx.rope(q[..., s.qk_nope :], ctx.cos, ctx.sin)
        ckv = self.kv_a_proj_with_mqa(x)
        c = self.kv_a_layernorm(ckv[:, : s.kv_lora_rank].contiguous())
        k_pe = ctx.rope(ckv[:, None, s.kv_lora_rank :], ctx.cos, ctx.sin)  # [T, 1, rope]
        lat = torch.cat([c, k_pe[:, 0]], dim=-1)
        if ctx.cp is not None:  # context parallelism: owners store, partials merged (engine/layers/mla_cp.py)
            o = mla_attend_cp(q_nope, q_pe, lat, ctx.cp, ctx.kv, self.layer_id, self.kv_b_proj.weight, s,
                              ctx.absorb_all)
            return self.o_proj(o.reshape(t, s.heads * s.v))
        ctx.kv.store(self.layer_id, ctx.batch.out_slots, lat[:, None])
        assert ctx.plan is not None
        o = mla_attend(q_nope, q_pe, ctx.plan, ctx.kv, self.layer_id, self.kv_b_proj.weight, s)
        return self.o_proj(o.reshape(t, s.heads * s.v))


class MLAContext:
    """What every layer of one forward reads: the batch, the pool, the attention plan, cos/sin."""

    def __init__(self, batch: ForwardBatch, kv: KVPool, plan: MLAPlan | None, rope: LatentRope, dtype: torch.dtype,
                 cp: ContextParallelAttention | None = None, absorb_all: bool = False) -> None:
        self.batch, self.kv, self.plan, self.rope = batch, kv, plan, rope
        self.cos, self.sin = rope.cos_sin(batch.positions, dtype)
        self.cp, self.absorb_all = cp, absorb_all  # cp: the prepared cp backend (plan None then)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype, moe: bool | None = None) -> None:
        """`moe` None: as the config says for `layer_id`; the MTP layer (models/nextn.py) sets it."""
        super().__init__()
        self.self_attn = MLAttention(cfg, layer_id, dtype)
        if moe is None:
            moe = cfg.is_moe_layer(layer_id)
        moe = moe and cfg.moe is not None
        self.mlp: nn.Module = MoE(cfg.hidden_size, cfg.moe, dtype) if moe else MLP(cfg, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, ctx: MLAContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As models/llama.py's layer: residual None at layer 0 (x is the embedding)."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        x = self.self_attn(h, ctx)
        if isinstance(self.mlp, MLP):
            h, residual = norm_linear(self.post_attention_layernorm, self.mlp.gate_up_proj, x, residual)
            return self.mlp.down(h), residual
        h, residual = self.post_attention_layernorm.add_forward(x, residual)
        return self.mlp(h, pad_rows(ctx.batch)), residual  # a CUDA graph's padding rows: not counted


class DeepseekV3Model(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class DeepseekV3ForCausalLM(nn.Module):
    """`forward` returns float32 logits [S, vocab] for batch.logit_indices, like LlamaForCausalLM."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if cfg.mla is None:
            raise ValueError(f"{cfg.architecture}: the config lacks the MLA fields (kv_lora_rank, ...)")
        self.config = cfg
        self.dtype = dtype
        self.model = DeepseekV3Model(cfg, dtype)
        self.lm_head = None if cfg.tie_word_embeddings else ParallelLMHead(cfg.hidden_size, cfg.vocab_size, dtype)
        self.rope = LatentRope(cfg)  # a plain attribute: module.to(dtype) must not cast the frequencies
        self.absorb_all = False  # tests: prefill rows in the absorbed form too
        self.decode_kernel: bool | None = None  # decode rows' triton kernel (None: on CUDA; tests force it)

    @staticmethod
    def kv_layout(cfg: ModelConfig) -> KVLayout:
        """One latent per token and layer: kv_lora_rank + qk_rope_head_dim values (576 for V3),
        the same on every rank (the heads are expanded from it)."""
        assert cfg.mla is not None
        return KVLayout.latent(cfg.mla.kv_lora_rank, cfg.mla.qk_rope_head_dim)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVPool, backend: AttentionBackend | None = None) -> torch.Tensor:
        """MLA attends the latent pool itself (engine/layers/mla_attention.py); of `backend` only an
        MLABackend's static decode table (a CUDA graph's capture and replays) and the step's draft
        trees are read."""
        x = self.model.embed_tokens(batch.input_ids)
        graph = backend.graph if isinstance(backend, MLABackend) else None
        flashmla = backend.fm if isinstance(backend, MLABackend) else None
        cp = backend if isinstance(backend, ContextParallelAttention) else None
        trees = backend.step_trees if backend is not None else None
        plan = (None if cp is not None
                else MLAPlan.build(batch, self.absorb_all, self.decode_kernel, graph, trees, flashmla, kv))
        ctx = MLAContext(batch, kv, plan, self.rope, x.dtype, cp, self.absorb_all)
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, ctx)
        idx = batch.logit_indices
        if idx.numel() == 0:
            return x.new_empty(0, self.config.vocab_size)
        h = self.model.norm(residual[idx] + x[idx])
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        return lm_logits(h, head.weight, self.config.vocab_size, head.packed)
