"""DeepSeek-V3's multi-token-prediction (MTP) layer as a speculative draft (NEXTN,
docs/architecture.md "Speculative decoding").

The checkpoint stores it after the last decoder layer, `model.layers.{num_hidden_layers}`: enorm,
hnorm, eh_proj (2H -> H), one decoder layer (MLA and, in V3, an MoE block), shared_head.norm and
shared_head.head (the LM head), often a copy of the embedding (embed_tokens). At position p it
reads (h_p, token p + 1), h_p the target's final hidden state (after its norm), and predicts
token p + 2:

    x = eh_proj([enorm(embed(t)) | hnorm(h)]);  x = decoder(x);  g = shared_head.norm(x)
    logits = shared_head.head(g)

g is also what the next draft step reads as h (SGLang chains one MTP layer so). The module's
parameters are named as in the checkpoint (`model.layers.{L}.`), so models/loader.py fills them
with the same mapping as the target's layers (fused gate/up, expert stacks, fp8 scales), and a
quantization ignore list names them as it names the checkpoint. The embedding and the head are
the target's unless the checkpoint stores the layer's own.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from engine.layers.forward import ForwardBatch
from engine.layers.kv_pool import KVPool
from engine.layers.mla_attention import MLABackend, MLAPlan
from engine.layers.parallel import Linear, ParallelLMHead, VocabParallelEmbedding
from models.config import ModelConfig
from models.deepseek_v3 import DecoderLayer, LatentRope, MLAContext
from models.llama import RMSNorm

ARCHS = ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM")


def nextn_layers(path: str | Path) -> int:
    """`num_nextn_predict_layers` of the model in `path` (0: none, or no config.json)."""
    f = Path(path) / "config.json"
    if not f.is_file():
        return 0
    return int(json.loads(f.read_text()).get("num_nextn_predict_layers") or 0)


class NextNLayer(DecoderLayer):
    """The MTP layer: a DeepSeek decoder layer (KV in layer 0 of its own pool; MoE whenever the
    model has experts, as in V3) plus its input projection and its head's norm."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, own_embed: bool, own_head: bool) -> None:
        super().__init__(cfg, 0, dtype, moe=cfg.moe is not None)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm = RMSNorm(h, eps, dtype)
        self.hnorm = RMSNorm(h, eps, dtype)
        self.eh_proj = Linear(2 * h, h, False, dtype)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(h, eps, dtype)
        if own_head:
            self.shared_head.head = ParallelLMHead(h, cfg.vocab_size, dtype)
        if own_embed:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, h, dtype)


class NextN(nn.Module):
    """The MTP layer `index` of a DeepSeek checkpoint. `share` gives it the target's embedding
    and LM head (held outside its parameters) for those the checkpoint lacks."""

    def __init__(self, cfg: ModelConfig, index: int, dtype: torch.dtype, own_embed: bool, own_head: bool) -> None:
        super().__init__()
        self.config, self.index = cfg, index
        self.model = nn.Module()
        self.model.layers = nn.ModuleDict({str(index): NextNLayer(cfg, dtype, own_embed, own_head)})
        self.rope = LatentRope(cfg)  # a plain attribute: module.to(dtype) must not cast the frequencies
        self.shared: tuple[nn.Module, nn.Module] | None = None

    @property
    def prefix(self) -> str:
        """The checkpoint names of this layer's tensors start so."""
        return f"model.layers.{self.index}."

    @property
    def layer(self) -> NextNLayer:
        return self.model.layers[str(self.index)]  # type: ignore[return-value]

    def share(self, embed: nn.Module, lm_head: nn.Module) -> None:
        self.shared = (embed, lm_head)

    def embedding(self) -> nn.Module:
        assert self.shared is not None
        return getattr(self.layer, "embed_tokens", None) or self.shared[0]

    def head(self) -> tuple[nn.Module, int]:
        assert self.shared is not None
        return getattr(self.layer.shared_head, "head", None) or self.shared[1], self.config.vocab_size

    def forward(self, ids: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch, kv: KVPool,
                backend: object = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows for the LM head, the hidden state the next draft step reads): both the normed output."""
        layer = self.layer
        e = self.embedding()(ids)
        x = layer.eh_proj(torch.cat([layer.enorm(e), layer.hnorm(hidden)], dim=-1))
        mla = backend if isinstance(backend, MLABackend) else None  # on CUDA: its own (engine/run/eagle.py)
        plan = MLAPlan.build(batch, graph=mla.graph if mla else None, flashmla=mla.fm if mla else None, kv=kv)
        ctx = MLAContext(batch, kv, plan, self.rope, x.dtype)
        x, residual = layer(x, None, ctx)
        g = layer.shared_head.norm(x + residual)
        return g, g

    @staticmethod
    def to_target(draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids
