"""Llama-family decoder (Llama 2/3/3.1, Mistral, Qwen2, Qwen3, SmolLM) over paged KV.

GQA, RoPE (optionally llama3-scaled), RMSNorm, SwiGLU; Qwen3's per-head q/k RMSNorm and
Qwen2's q/k/v bias are config flags. Each layer has one fused qkv_proj and one fused
gate_up_proj; models/loader.py maps HF's separate q/k/v and gate/up tensors into them.
Parameters are allocated uninitialised (torch.empty) on the current default device: a
loader fills every one of them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.run.attention import AttentionBackend
from engine.run.forward import ForwardBatch
from engine.run.kv_pool import KVPool
from models.config import ModelConfig, RopeScaling


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T (+ b), without nn.Linear's (slow, useless here) random init."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param(out_features, in_features, dtype=dtype)
        self.bias = _param(out_features, dtype=dtype) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    def __init__(self, num: int, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param(num, dim, dtype=dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, cast back before the weight (as HF Llama does)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param(dim, dtype=dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


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


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """cos, sin [T, head_dim] in `dtype`, computed in float32 (rotate-half layout)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] by cos/sin [T, D] (HF's rotate_half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.qkv_proj = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, cfg.attention_bias, dtype)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, cfg.o_proj_bias, dtype)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        kv: KVPool,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # Qwen3: per-head norm before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        o = backend.forward(q, k, v, self.layer_id, batch, kv)
        return self.o_proj(o.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, False, dtype)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, False, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_id, dtype)
        self.mlp = MLP(cfg, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch,
                kv: KVPool, backend: AttentionBackend) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), rope, batch, kv, backend)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM. `forward` returns float32 logits [S, vocab] for batch.logit_indices."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = cfg
        self.dtype = dtype
        self.model = LlamaModel(cfg, dtype)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, False, dtype)
        # a plain attribute, not a buffer: module.to(dtype) must not cast RoPE frequencies
        self._inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVPool, backend: AttentionBackend) -> torch.Tensor:
        h = self.model.embed_tokens(batch.input_ids)
        if self._inv_freq.device != h.device:  # once, after the first move to a device
            self._inv_freq = self._inv_freq.to(h.device)
        rope = rope_cos_sin(batch.positions, self._inv_freq, h.dtype)
        for layer in self.model.layers:
            h = layer(h, rope, batch, kv, backend)
        # the final norm is per token: select the sampled rows first
        h = self.model.norm(h[batch.logit_indices])
        w = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(h, w).float()
