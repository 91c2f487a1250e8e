"""Mixture-of-experts decoders on the Llama-family attention: Qwen3-MoE and GLM-4.5 (Glm4Moe).

Both are models/llama.py's decoder (GQA over paged KV, RMSNorm, fused QKV, the same norms and
embedding) with the MLP of the layers `cfg.moe.layers` an `engine.layers.moe.MoE` block (the
others keep the dense SwiGLU MLP of `intermediate_size`):

* Qwen3-MoE: per-head q/k RMSNorm, softmax top-k routing (`norm_topk_prob`), no shared experts;
  dense layers from `mlp_only_layers` / `decoder_sparse_step`.
* GLM-4.5: bias on q/k/v (not o_proj), optional q/k norm (`use_qk_norm`), RoPE on the first
  `partial_rotary_factor` of each head (`PartialRotary`), sigmoid grouped top-k with the
  score-correction bias (noaux_tc), `routed_scaling_factor`, shared experts, and the first
  `first_k_dense_replace` layers dense.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers import ops
from engine.layers.context import ForwardContext, RopeState
from engine.layers.moe import MoE, pad_rows
from models.config import ModelConfig
from models.llama import DecoderLayer, LlamaForCausalLM, norm_linear, rope_frequencies


class PartialRotary(ops.Rotary):
    """Neox-style RoPE on the first `rotary_dim` dims of each head; the rest pass through (as
    transformers' Glm4Moe apply_rotary_pos_emb). Always the torch path: the fused GPU kernels
    (flashinfer's rope, the triton q/k-norm + RoPE + store prologue) rotate whole heads, so
    `prepare` never asks for them."""

    def __init__(self, inv_freq: torch.Tensor, rotary_dim: int, head_dim: int, max_positions: int,
                 factor: float = 1.0) -> None:
        super().__init__(inv_freq, rotary_dim, max_positions, factor)
        self.full_dim = head_dim

    def prepare(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeState:
        cos, sin = ops.rope_cos_sin(positions, self._inv_freq_on(positions.device), dtype, self.factor)
        return RopeState(False, positions, cos=cos, sin=sin)

    def _rotate(self, x: torch.Tensor, state: RopeState) -> torch.Tensor:
        rd = self.head_dim
        return torch.cat((ops.apply_rope(x[..., :rd], state.cos, state.sin), x[..., rd:]), dim=-1)

    def apply(self, q: torch.Tensor, k: torch.Tensor, state: RopeState) -> tuple[torch.Tensor, torch.Tensor]:
        return self._rotate(q, state), self._rotate(k, state)

    def apply_qkv(
        self, qkv: torch.Tensor, num_q: int, num_kv: int, state: RopeState
    ) -> tuple[torch.Tensor, torch.Tensor]:
        t, d = qkv.shape[0], self.full_dim
        qk = self._rotate(qkv[:, : (num_q + num_kv) * d].view(t, num_q + num_kv, d), state)
        return qk[:, :num_q], qk[:, num_q:]


class MoeDecoderLayer(DecoderLayer):
    """A Llama decoder layer whose MLP is an MoE block where the config says so."""

    def make_mlp(self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype) -> nn.Module:
        if cfg.moe is not None and cfg.is_moe_layer(layer_id):
            return MoE(cfg.hidden_size, cfg.moe, dtype)
        return super().make_mlp(cfg, layer_id, dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(self.mlp, MoE):
            return super().forward(x, residual, ctx)
        qkv, residual = norm_linear(self.input_layernorm, self.self_attn.qkv_proj, x, residual)
        x = self.self_attn(qkv, ctx)
        norm = self.post_attention_layernorm
        folded = self.mlp.add_norm_forward(x, residual, norm.weight, norm.eps)  # one token: no norm launch
        if folded is not None:
            return folded
        h, residual = norm.add_forward(x, residual)
        return self.mlp(h, pad_rows(ctx.batch)), residual  # a CUDA graph's padding rows: not counted


class MoeForCausalLM(LlamaForCausalLM):
    """Qwen3MoeForCausalLM and Glm4MoeForCausalLM (their differences are config fields)."""

    layer_cls = MoeDecoderLayer

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(cfg, dtype)
        if cfg.rotary_dim < cfg.head_dim:
            inv_freq, factor = rope_frequencies(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)
            self.rotary = PartialRotary(inv_freq, cfg.rotary_dim, cfg.head_dim, cfg.max_position_embeddings, factor)

    @property
    def supports_cuda_graph(self) -> bool:
        """Capturable when every MoE block takes the fused kernels (CUDA outside deterministic
        inference); the torch path reads per-expert token counts on the host (engine/layers/moe.py)."""
        return all(m.supports_cuda_graph for m in self.modules() if isinstance(m, MoE))
