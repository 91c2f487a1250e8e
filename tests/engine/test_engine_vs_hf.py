"""Differential: the engine (scheduler + runner replaying the Step stream, with overlap,
chunked prefill, the prefix cache and retraction) against transformers' greedy decoding on
the same weights: tokens equal, for several prompts of mixed lengths batched together."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from engine.config import ServerConfig
from engine.local import LocalEngine
from msgs.params import SamplingParams

GREEDY = SamplingParams(max_new_tokens=32, temperature=0, ignore_eos=True)


def _save(hf_config, path: Path) -> Path:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=255,
        bos_token_id=1,
        tie_word_embeddings=False,
        rope_theta=10000.0,
    )
    return _save(cfg, tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory) -> Path:
    cfg = Qwen3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        eos_token_id=255,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
    )
    return _save(cfg, tmp_path_factory.mktemp("tiny-qwen3"))


def hf_greedy(path: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    outs = []
    for p in prompts:
        ids = model.generate(
            torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0, min_new_tokens=n
        )
        outs.append(ids[0, len(p) :].tolist())
    return outs


def prompts_for(vocab: int, lengths: tuple[int, ...], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab - 2, (n,), generator=g).tolist() for n in lengths]


def engine(path: Path, **kw) -> LocalEngine:
    # float32, as transformers here: greedy tokens equal (auto is bf16 on a CPU with native bf16)
    base = dict(model=str(path), device="cpu", dtype="float32", max_total_tokens=4096, page_size=4,
                max_prefill_tokens=24)
    return LocalEngine(ServerConfig(**{**base, **kw}))


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen3"])
@pytest.mark.parametrize("overlap", [True, False])
def test_random_weights_batch_prefix_and_chunks(fixture: str, overlap: bool, request) -> None:
    path = request.getfixturevalue(fixture)
    prompts = prompts_for(256, (5, 17, 40, 3, 26))
    want = hf_greedy(path, prompts, 32)
    eng = engine(path, disable_overlap=not overlap)
    got = eng.generate(prompts, GREEDY)
    assert [r.output_ids for r in got] == want
    assert all(r.finish_reason == "length" for r in got)
    # a prompt sharing a cached 40-token prefix: prefilled from the cache, chunked (budget 24)
    longer = [prompts[2] + [7, 8, 9, 10, 11] + prompts[1]]
    again = eng.generate(longer, GREEDY)[0]
    assert again.cached_tokens == 40
    assert again.output_ids == hf_greedy(path, longer, 32)[0]
    assert eng.core.idle and eng.core.leak_free()
    assert eng.runner.replica.digest() == eng.core.replica.digest()


def test_retraction_under_page_pressure_keeps_outputs_exact(tiny_llama: Path) -> None:
    prompts = prompts_for(256, (12, 9, 14, 11), seed=3)
    want = hf_greedy(tiny_llama, prompts, 32)
    eng = engine(tiny_llama, max_total_tokens=96, disable_radix_cache=False)  # 24 pages of 4 tokens
    got = eng.generate(prompts, GREEDY)
    assert eng.core.retractions > 0
    assert [r.output_ids for r in got] == want
    assert eng.core.leak_free()


def test_seeded_sampling_reproducible_across_batches(tiny_llama: Path) -> None:
    prompts = prompts_for(256, (6, 10, 7), seed=5)
    params = SamplingParams(max_new_tokens=16, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    eng = engine(tiny_llama)
    together = eng.generate(prompts, params)
    alone = eng.generate([prompts[1]], params)[0]
    assert together[1].output_ids == alone.output_ids
    other = eng.generate([prompts[1]], SamplingParams(max_new_tokens=16, temperature=0.9, seed=99, ignore_eos=True))
    assert other[0].output_ids != alone.output_ids


def test_default_model_matches_transformers(default_model_dir: Path) -> None:
    """SmolLM2 (the converted GGUF): a batch of chat prompts prefilled in 16-token chunks, then a
    follow-up turn served from the prefix cache; greedy tokens equal transformers'."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)

    def chat(*turns: str) -> list[int]:
        msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
        text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        return tok.encode(text, add_special_tokens=False)

    prompts = [chat("What is the capital of France?"), chat("Write a haiku about the sea."), chat("2 + 2 =")]
    eng = engine(default_model_dir, page_size=16, max_prefill_tokens=16, max_total_tokens=8192)
    got = eng.generate(prompts, GREEDY)
    assert [r.output_ids for r in got] == hf_greedy(default_model_dir, prompts, 32)
    follow = [chat("What is the capital of France?", "Paris.", "And of Italy?")]
    again = eng.generate(follow, GREEDY)[0]
    assert again.cached_tokens >= 16
    assert again.output_ids == hf_greedy(default_model_dir, follow, 32)[0]


def test_same_step_prefix_sharing_is_exact(tiny_llama: Path) -> None:
    """Siblings admitted in one step read the first one's prompt KV written in that same forward."""
    prompt = prompts_for(256, (23,), seed=9)[0]
    want = hf_greedy(tiny_llama, [prompt], 32)[0]
    got = engine(tiny_llama, max_prefill_tokens=128).generate([prompt] * 3, GREEDY)
    assert [r.cached_tokens for r in got] == [0, 20, 20]
    assert all(r.output_ids == want for r in got)


def test_fp8_kv_cache_stays_close(tiny_llama: Path) -> None:
    """--kv-cache-dtype fp8_e4m3 stores one byte per K/V value; teacher-forced logits read back
    through it stay close to those of the full-precision pool, and the engine runs with it."""
    from engine.layers.attention import TorchAttention
    from engine.layers.forward import ForwardBatch
    from engine.layers.kv_pool import KVPool
    from models.registry import load_model

    model, mcfg = load_model(tiny_llama, device="cpu", progress=False)
    tokens = prompts_for(256, (48,), seed=4)[0]
    pages = list(range(1, 13))

    def logits(kv_dtype: torch.dtype) -> torch.Tensor:
        pool = KVPool(mcfg.num_layers, 16, 4, mcfg.num_kv_heads, mcfg.head_dim, kv_dtype, "cpu")
        backend, out = TorchAttention("cpu"), []
        steps = [(tokens[:24], 0)] + [([tokens[i]], i) for i in range(24, 48)]  # decodes read the pool
        for ids, start in steps:
            batch = ForwardBatch.from_requests([(ids, start, pages)], 4, "cpu")
            backend.prepare(batch)
            out.append(model(batch, pool, backend))
        return torch.cat(out)

    full, fp8 = logits(torch.float32), logits(torch.float8_e4m3fn)
    rel = ((full - fp8).abs().max() / full.abs().max()).item()
    cos = torch.nn.functional.cosine_similarity(full, fp8, dim=-1).min().item()
    print(f"fp8 KV: max rel diff {rel:.4f}, min cosine {cos:.5f}")
    assert rel < 0.1 and cos > 0.99, (rel, cos)
    eng8 = engine(tiny_llama, kv_cache_dtype="fp8_e4m3")
    assert eng8.runner.kv.k[0].dtype == torch.float8_e4m3fn and eng8.runner.kv.k[0].element_size() == 1
    out = eng8.generate(prompts_for(256, (9, 30), seed=4), GREEDY)
    assert all(len(r.output_ids) == 32 for r in out) and eng8.core.leak_free()


def test_retraction_keeps_penalized_seeded_sampling_identical(tiny_llama: Path) -> None:
    """A retracted request is re-admitted with its generated tokens as penalty history, so
    seeded sampling with penalties gives the same tokens as a run that never retracts."""
    prompts = prompts_for(256, (12, 9, 14, 11), seed=3)
    # negative penalties make the history decisive: earlier tokens are strongly repeated
    params = SamplingParams(max_new_tokens=32, temperature=0.8, seed=7, frequency_penalty=-1.0,
                            presence_penalty=-1.0, repetition_penalty=0.8, ignore_eos=True)
    roomy = engine(tiny_llama).generate(prompts, params)
    tight = engine(tiny_llama, max_total_tokens=96)
    got = tight.generate(prompts, params)
    assert tight.core.retractions > 0
    assert [r.output_ids for r in got] == [r.output_ids for r in roomy]
