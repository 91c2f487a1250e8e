"""Tensor parallelism on CPU (gloo): tp=2 gives tp=1's greedy tokens, every rank's replica
digest and token chain checked at every step (tp_harness: real ranks in spawned processes).

Cases: the default model (SmolLM2-135M: 3 K/V heads, split 2 + 1 over 2 ranks); random Qwen3
configs with one K/V head (replicated on both ranks), with 3 K/V heads and an odd vocabulary
and MLP width (uneven splits), untied LM head; each with chunked prefill, a second wave that
reuses cached prefixes, and overlap (one step planned ahead).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model_harness import make_hf_dir, tiny_config
from tp_harness import run_tp

from engine.config import ServerConfig
from engine.layers.parallel import head_shard, range_split
from models.config import ModelConfig
from models.llama import LlamaForCausalLM
from models.loader import init_dummy, load_safetensors
from msgs.params import SamplingParams

GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)


def _waves(vocab: int, n: int = 3, length: int = 37) -> list:
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(3, vocab, (24,), generator=g).tolist()  # a common prefix: cached in wave 2
    first = [shared + torch.randint(3, vocab, (length - 24 + i,), generator=g).tolist() for i in range(n)]
    second = [shared + torch.randint(3, vocab, (5 + i,), generator=g).tolist() for i in range(n)]
    return [(first, GREEDY), (second, GREEDY)]


def _cfg(model: Path, tp: int, **kw: object) -> ServerConfig:
    # page 4 and a 16-token budget: prompts are prefilled in chunks, prefixes cached page by page
    return ServerConfig(model=str(model), device="cpu", tp_size=tp, cpu_threads=1, page_size=4,
                        max_prefill_tokens=16, max_total_tokens=2048, max_running_requests=8, **kw)


def _check_same(model: Path, vocab: int, **kw: object) -> None:
    waves = _waves(vocab)
    one = run_tp(_cfg(model, 1, **kw), waves)
    two = run_tp(_cfg(model, 2, **kw), waves)
    assert [[o.output_ids for o in w] for w in two] == [[o.output_ids for o in w] for w in one]
    assert all(len(o.output_ids) == GREEDY.max_new_tokens for w in two for o in w)
    assert min(o.cached_tokens for o in two[1]) >= 20, "the second wave reuses the shared prefix"


def test_tp2_default_model(default_model_dir: Path) -> None:
    _check_same(default_model_dir, ModelConfig.from_dir(default_model_dir).vocab_size)


@pytest.mark.parametrize(("kv_heads", "heads", "vocab", "inter", "tied"), [
    (1, 4, 256, 96, True),  # fewer K/V heads than ranks: the one K/V head is replicated
    (3, 6, 251, 95, False),  # 3 K/V heads on 2 ranks (2 + 1), odd vocab and MLP: uneven shards
])
def test_tp2_random_qwen3(tmp_path: Path, kv_heads: int, heads: int, vocab: int, inter: int, tied: bool) -> None:
    cfg = tiny_config("tiny-qwen3") | {"num_key_value_heads": kv_heads, "num_attention_heads": heads,
                                       "vocab_size": vocab, "intermediate_size": inter, "tie_word_embeddings": tied}
    model = make_hf_dir(tmp_path / "m", cfg)
    _check_same(model, vocab)


def test_tp2_dummy_weights_no_overlap(tmp_path: Path) -> None:
    """The dummy load format gives each rank the slices of tp=1's weights (same tokens)."""
    model = make_hf_dir(tmp_path / "m", tiny_config("tiny-qwen3") | {"num_key_value_heads": 1})
    _check_same(model, 256, load_format="dummy", disable_overlap=True)


def test_head_shard_layouts() -> None:
    assert [head_shard(9, 3, r, 2) for r in range(2)] == [
        type(head_shard(9, 3, 0, 2))((0, 6), (0, 2)), type(head_shard(9, 3, 0, 2))((6, 9), (2, 3))]
    assert [head_shard(8, 2, r, 4).kv for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    with pytest.raises(ValueError, match="divisible"):
        head_shard(8, 2, 0, 3)
    assert [range_split(251, 2, r) for r in range(2)] == [(0, 126), (126, 251)]


def test_loader_fills_shards_like_dummy_slices(tmp_path: Path) -> None:
    """A checkpoint read at tp 1 equals the fused parameters the shards are cut from (the
    loader's piece arithmetic); the dummy init at tp 1 is unchanged by the sharding metadata."""
    path = make_hf_dir(tmp_path / "m", tiny_config("tiny-qwen3"))
    mcfg = ModelConfig.from_dir(path)
    model = LlamaForCausalLM(mcfg)
    load_safetensors(model, mcfg, path, progress=False)
    from safetensors.torch import load_file

    raw = load_file(str(path / "model.safetensors"))
    qkv = model.model.layers[1].self_attn.qkv_proj.weight
    want = torch.cat([raw[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv"])
    assert torch.equal(qkv, want)
    a, b = LlamaForCausalLM(mcfg), LlamaForCausalLM(mcfg)
    init_dummy(a, 3)
    init_dummy(b, 3)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
