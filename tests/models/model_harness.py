"""Test harness: greedy decoding through Strata's paged model, and the HF reference.

`PagedGreedy` plays a tiny scheduler: it hands out shuffled pages (so page tables are
non-contiguous), batches every live sequence into one ForwardBatch per step, and can
split prompts into chunks so prefill chunks and decodes share a step.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from engine.layers.attention import TorchAttention
from engine.layers.forward import ForwardBatch
from engine.layers.kv_pool import KVPool
from models.config import ModelConfig
from models.registry import kv_layout

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"

TINY_QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "num_hidden_layers": 2,
    "vocab_size": 256,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "eos_token_id": 2,
}


def tiny_config(name: str) -> dict:
    """A tiny config from configs/ (tiny-llama, tiny-qwen3) or the inline Qwen2 one."""
    if name == "tiny-qwen2":
        return dict(TINY_QWEN2)
    cfg = json.loads((CONFIGS / name / "config.json").read_text())
    cfg.pop("torch_dtype", None)
    return cfg


@dataclass
class Seq:
    """One request: all its tokens so far, its pages, and how many tokens the pool holds."""

    tokens: list[int]
    pages: list[int]
    cached: int = 0
    out: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)


class PagedGreedy:
    def __init__(self, model: torch.nn.Module, cfg: ModelConfig, page_size: int = 4, num_pages: int = 256) -> None:
        self.model, self.cfg, self.page_size = model, cfg, page_size
        # the layout the model declares (K and V, or MLA's latent)
        self.kv = KVPool.from_layout(kv_layout(cfg), cfg.num_layers, num_pages, page_size, torch.float32, "cpu")
        self.backend = TorchAttention("cpu")
        self.free = list(range(1, num_pages))  # page 0 is the padding page
        random.Random(0).shuffle(self.free)

    def new_seq(self, prompt: Sequence[int], max_new: int, share: Seq | None = None, shared_tokens: int = 0) -> Seq:
        """A sequence with room for max_new tokens; the first `shared_tokens` (whole pages) reuse `share`'s KV."""
        assert shared_tokens % self.page_size == 0
        shared = share.pages[: shared_tokens // self.page_size] if share else []
        need = math.ceil((len(prompt) + max_new) / self.page_size) - len(shared)
        pages = shared + [self.free.pop() for _ in range(need)]
        return Seq(tokens=list(prompt), pages=pages, cached=shared_tokens)

    def step(self, seqs: list[Seq], chunk: int | None) -> None:
        """One forward: each seq feeds up to `chunk` uncached tokens; finished prompts sample."""
        reqs, sample = [], []
        for s in seqs:
            n = len(s.tokens) - s.cached if chunk is None else min(chunk, len(s.tokens) - s.cached)
            reqs.append((s.tokens[s.cached : s.cached + n], s.cached, s.pages))
            s.cached += n
            sample.append(s.cached == len(s.tokens))
        batch = ForwardBatch.from_requests(reqs, self.page_size, "cpu", sample)
        self.backend.prepare(batch)
        logits = self.model(batch, self.kv, self.backend)
        assert logits.shape == (sum(sample), self.cfg.vocab_size) and logits.dtype == torch.float32
        for s, row in zip([s for s, m in zip(seqs, sample, strict=True) if m], logits, strict=True):
            tok = int(row.argmax())
            s.out.append(tok)
            s.tokens.append(tok)
            s.logits.append(row)

    def run(self, seqs: list[Seq], max_new: int, chunk: int | None = None, stop: set[int] | None = None) -> None:
        """Step until every seq has max_new tokens (or hit a stop token)."""
        def live(s: Seq) -> bool:
            return len(s.out) < max_new and not (stop and s.out and s.out[-1] in stop)

        while active := [s for s in seqs if live(s)]:
            self.step(active, chunk)


def hf_greedy(model: torch.nn.Module, prompt: Sequence[int], n: int,
              stop: set[int] | None = None) -> tuple[list[int], torch.Tensor]:
    """HF greedy with its own KV cache: (tokens, float32 logits [n, vocab])."""
    ids = torch.tensor([list(prompt)])
    past, toks, rows = None, [], []
    with torch.inference_mode():
        for _ in range(n):
            out = model(input_ids=ids, past_key_values=past, use_cache=True)
            past, row = out.past_key_values, out.logits[0, -1].float()
            tok = int(row.argmax())
            toks.append(tok)
            rows.append(row)
            if stop and tok in stop:
                break
            ids = torch.tensor([[tok]])
    return toks, torch.stack(rows)


def load_hf(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def make_hf_dir(path: Path, config: dict, seed: int = 0, std: float = 0.1) -> Path:
    """Save a random-weight HF model of `config` to `path`; every tensor is perturbed
    (norms around 1, biases non-zero) so the comparison exercises all of them."""
    cfg = AutoConfig.for_model(**config)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, std)
    model.save_pretrained(path, safe_serialization=True)
    return path
