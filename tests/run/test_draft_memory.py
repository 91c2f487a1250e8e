"""Memory sizing with speculative decoding (engine/run/memory.py `draft_bytes`): what the KV pool
leaves room for equals what the draft then allocates: a separate draft model's KV pool and
weights, an EAGLE3 head's KV and hidden-state pools; nothing for NGRAM or a self-draft."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from engine.config import ServerConfig
from engine.run.assembly import assemble, make_speculator
from engine.run.memory import draft_bytes
from tests.models.draft_heads import write_head


def _allocated(cfg: ServerConfig) -> tuple[int, int, int, int]:
    """(draft bytes a token, draft weight bytes) the sizing expects, and what the draft's pools
    (a token: their bytes over the target's pool tokens) and parameters take."""
    a = assemble(cfg, 0)
    draft = make_speculator(cfg, a).draft
    tokens = a.num_pages * cfg.page_size
    pools = draft.kv.nbytes() + (draft.hidden.numel() * draft.hidden.element_size() if hasattr(draft, "hidden") else 0)
    module = draft.model if hasattr(draft, "model") else draft.head
    weights = sum(p.numel() * p.element_size() for p in module.parameters())
    return (*draft_bytes(cfg, a.shard, a.dtype, a.kv_dtype), pools // tokens, weights)


def test_separate_draft_model_pool_and_weights(default_model_dir: Path) -> None:
    cfg = ServerConfig(model=str(default_model_dir), dtype="float32", max_total_tokens=512,
                       speculative_algorithm="STANDALONE", speculative_draft_model_path=str(default_model_dir))
    per_token, fixed, pools, weights = _allocated(cfg)
    assert per_token == pools  # its own pool over the target's pages, the target's size here
    assert abs(fixed - weights) <= 0.02 * weights


def test_eagle3_head_pools(default_model_dir: Path, tmp_path: Path) -> None:
    target = json.loads((default_model_dir / "config.json").read_text())
    head = write_head(tmp_path / "eagle3", target, "EAGLE3", draft_vocab=4096)
    cfg = ServerConfig(model=str(default_model_dir), dtype="float32", max_total_tokens=512,
                       speculative_algorithm="EAGLE3", speculative_draft_model_path=str(head))
    per_token, fixed, pools, weights = _allocated(cfg)
    assert per_token == pools and 0 < fixed and fixed >= weights  # (the shared embedding counted: safe side)


def test_no_draft_costs_nothing(default_model_dir: Path) -> None:
    for kw in ({}, {"speculative_algorithm": "NGRAM"},
               {"speculative_algorithm": "STANDALONE", "speculative_draft_layers": 4}):
        cfg = ServerConfig(model=str(default_model_dir), **kw)
        assert draft_bytes(cfg, None, torch.float32, torch.float32) == (0, 0)
