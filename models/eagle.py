"""EAGLE and EAGLE-3 draft heads (speculative decoding, docs/architecture.md): small Llama-style
models fed the target's hidden states, in the HF checkpoint formats SGLang reads.

EAGLE (v1/v2, `LlamaForCausalLMEagle`): x = fc([embed(t) | h]) (fc: 2H -> H, usually with a
bias), then `num_hidden_layers` Llama layers (layer 0 without its input norm, as EAGLE trained
it); the output x + residual, with no final norm, goes through the target's LM head and is the
hidden state the next draft step is fed. h: the target's final hidden state (after its norm).

EAGLE-3 (`LlamaForCausalLMEagle3`): h = fc([a_low | a_mid | a_high]) (3 x the target's hidden
-> H) over three of the target's residual streams; one `midlayer` whose attention reads
[input_layernorm(embed(t)) | hidden_norm(h)] (2H wide) with h as its residual; `norm` then
`lm_head` over the draft vocabulary (`draft_vocab_size`), whose ids map to the target's by
`d2t` (target id = draft id + d2t[draft id]). The pre-norm output feeds the next draft step
(without fc: it is already H wide).

The head at position p reads (h_p, token p + 1) and predicts token p + 2: its KV entry p pairs
the target's hidden state at p with the next token. Parameters are named as in the checkpoint
(`fc`, `layers.N` / `midlayer`, `norm`, `lm_head`, `embed_tokens`, `d2t`, `t2d`); q/k/v and
gate/up are fused by models/loader.py as for the target.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from engine.layers import ops
from engine.layers.attention import AttentionBackend
from engine.layers.context import ForwardContext
from engine.layers.forward import ForwardBatch
from engine.layers.kv_pool import KVPool
from engine.layers.parallel import (
    ColumnParallelLinear,
    Linear,
    ParallelLMHead,
    VocabParallelEmbedding,
    head_shard,
    parallel_state,
)
from models.config import ModelConfig
from models.llama import MLP, Attention, DecoderLayer, RMSNorm, norm_linear, rope_frequencies
from models.loader import checkpoint_files


@dataclass(frozen=True)
class HeadSpec:
    """What a head directory holds: its decoder shapes (a Llama ModelConfig), the draft
    vocabulary, and which optional tensors its checkpoint stores."""

    kind: str  # EAGLE | EAGLE3
    cfg: ModelConfig
    target_hidden: int  # the width of the target hidden states it reads (EAGLE3: each of the three)
    draft_vocab: int  # EAGLE3: lm_head rows; EAGLE: the target's vocabulary (its LM head)
    aux_layers: tuple[int, ...] | None  # EAGLE3 `eagle_aux_hidden_state_layer_ids`, if the config names them
    names: frozenset[str]  # the checkpoint's tensor names

    @property
    def own_embed(self) -> bool:
        return "embed_tokens.weight" in self.names

    @property
    def own_head(self) -> bool:
        """EAGLE3 with its own (draft-vocabulary) LM head; EAGLE always uses the target's."""
        return self.kind == "EAGLE3" and "lm_head.weight" in self.names


def read_head(path: str | Path, kind: str) -> HeadSpec:
    """The head in `path` (config.json + safetensors), read as `kind` (the flag decides the format:
    EAGLE checkpoints often name their architecture LlamaForCausalLM)."""
    path = Path(path)
    raw: dict[str, Any] = json.loads((path / "config.json").read_text())
    d = {**raw, "architectures": ["LlamaForCausalLM"]}  # Llama shapes; the kind says the rest
    cfg = ModelConfig.from_dict(d)
    names = frozenset(tensor_names(path))
    target_hidden = int(raw.get("target_hidden_size") or cfg.hidden_size)
    draft_vocab = int(raw.get("draft_vocab_size") or cfg.vocab_size) if kind == "EAGLE3" else cfg.vocab_size
    eagle = raw.get("eagle_config") or {}
    aux = eagle.get("eagle_aux_hidden_state_layer_ids")
    return HeadSpec(kind, cfg, target_hidden, draft_vocab, tuple(int(i) for i in aux) if aux else None, names)


def tensor_names(path: str | Path) -> list[str]:
    """Every tensor name of the safetensors checkpoint in `path` (headers only)."""
    out: list[str] = []
    for f in checkpoint_files(Path(path)):
        with safe_open(str(f), framework="pt") as h:
            out.extend(h.keys())
    return out


def head_keeps(spec: HeadSpec) -> Any:  # noqa: ANN401
    """The checkpoint tensors the head loads: EAGLE's layer 0 has no input norm and uses the
    target's LM head (some checkpoints store both anyway); EAGLE3's t2d is not needed."""
    skip = {"t2d"} if spec.kind == "EAGLE3" else {"lm_head.weight", "layers.0.input_layernorm.weight"}
    return lambda name: name not in skip


class _NoInputNormLayer(DecoderLayer):
    """EAGLE's layer 0: its input (fc's output) goes to attention un-normalized and is the residual."""

    def __init__(self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype) -> None:
        super().__init__(cfg, layer_id, dtype)
        del self.input_layernorm

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.self_attn(self.self_attn.qkv_proj(x), ctx)
        h, residual = norm_linear(self.post_attention_layernorm, self.mlp.gate_up_proj, a, x)
        return self.mlp.down(h), residual


class _WideAttention(Attention):
    """EAGLE3's attention: q/k/v projected from [embedding | hidden] (2H wide)."""

    def __init__(self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype) -> None:
        super().__init__(cfg, layer_id, dtype)
        t = parallel_state().tp
        heads = head_shard(cfg.num_heads, cfg.num_kv_heads, t.rank, t.world)
        d = cfg.head_dim
        (qs, qe), (ks, ke) = heads.q, heads.kv
        parts = [("q", cfg.q_size, (qs * d, qe * d)), ("k", cfg.kv_size, (ks * d, ke * d)),
                 ("v", cfg.kv_size, (ks * d, ke * d))]
        self.qkv_proj = ColumnParallelLinear(2 * cfg.hidden_size, parts, cfg.attention_bias, dtype)


class Eagle3MidLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = _WideAttention(cfg, 0, dtype)
        self.mlp = MLP(cfg, dtype)
        self.input_layernorm = RMSNorm(h, eps, dtype)
        self.hidden_norm = RMSNorm(h, eps, dtype)
        self.post_attention_layernorm = RMSNorm(h, eps, dtype)

    def forward(self, emb: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The pre-norm output (MLP output + residual); `hidden` is the residual."""
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)
        a = self.self_attn(self.self_attn.qkv_proj(x), ctx)
        h, residual = norm_linear(self.post_attention_layernorm, self.mlp.gate_up_proj, a, hidden)
        return self.mlp.down(h) + residual


class EagleHead(nn.Module):
    """An EAGLE or EAGLE3 head. `embed` / `lm_head`: the target's, where the checkpoint has none
    (held outside the module's parameters, so loading and counting see only the head's own)."""

    def __init__(self, spec: HeadSpec, dtype: torch.dtype, max_positions: int) -> None:
        super().__init__()
        cfg, h = spec.cfg, spec.cfg.hidden_size
        self.spec, self.config = spec, cfg
        if spec.own_embed:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, h, dtype)
        if spec.kind == "EAGLE3":
            self.fc = Linear(3 * spec.target_hidden, h, "fc.bias" in spec.names, dtype)
            self.midlayer = Eagle3MidLayer(cfg, dtype)
            self.norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
            if spec.own_head:
                self.lm_head = ParallelLMHead(h, spec.draft_vocab, dtype)
            if "d2t" in spec.names:
                self.d2t = nn.Parameter(torch.empty(spec.draft_vocab, dtype=torch.int64), requires_grad=False)
        else:
            self.fc = Linear(2 * h, h, "fc.bias" in spec.names, dtype)
            self.layers = nn.ModuleList((_NoInputNormLayer if i == 0 else DecoderLayer)(cfg, i, dtype)
                                        for i in range(cfg.num_layers))
        inv_freq, factor = rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.rotary = ops.Rotary(inv_freq, cfg.head_dim, max(max_positions, cfg.max_position_embeddings), factor)
        self.shared: tuple[nn.Module, nn.Module] | None = None  # (embedding, LM head) of the target

    def share(self, embed: nn.Module, lm_head: nn.Module) -> None:
        self.shared = (embed, lm_head)

    def embedding(self) -> nn.Module:
        assert self.shared is not None
        return self.embed_tokens if self.spec.own_embed else self.shared[0]

    def head(self) -> tuple[nn.Module, int]:
        """(the module whose weight/packed are the LM head, its rows)."""
        assert self.shared is not None
        if self.spec.own_head:
            return self.lm_head, self.spec.draft_vocab
        return self.shared[1], self.spec.draft_vocab

    def feature(self, aux: list[torch.Tensor]) -> torch.Tensor:
        """EAGLE3: fc over the three target residual streams (what the hidden pool stores)."""
        return self.fc(torch.cat(aux, dim=-1))

    def forward(self, ids: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch, kv: KVPool,
                backend: AttentionBackend | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows for the LM head, the hidden state the next draft step reads), per token of
        `batch` (its attention already prepared on `backend`)."""
        emb = self.embedding()(ids)
        assert backend is not None
        ctx = ForwardContext(batch, kv, backend, self.rotary, self.rotary.prepare(batch.positions, emb.dtype))
        if self.spec.kind == "EAGLE3":
            out = self.midlayer(emb, hidden, ctx)
            return self.norm(out), out
        x = self.fc(torch.cat([emb, hidden], dim=-1))
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, ctx)
        out = x + residual
        return out, out

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids as target ids (EAGLE3's d2t; identity otherwise)."""
        d2t = getattr(self, "d2t", None)
        return draft_ids if d2t is None else draft_ids + d2t[draft_ids]
