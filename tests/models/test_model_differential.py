"""Strata's paged Llama-family model vs transformers on the same weights (fp32, CPU).

Covers batched prefill of mixed-length prompts, batched decode, chunked prefill mixed
with decodes in one step, and prefill of only a suffix over cached prefix pages.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from model_harness import PagedGreedy, Seq, hf_greedy, load_hf

from models.registry import load_model

ATOL = 1e-3
MAX_NEW = 32


def _prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _check_against_hf(hf: torch.nn.Module, seqs: list[Seq], prompts: list[list[int]], n: int) -> None:
    for s, prompt in zip(seqs, prompts, strict=True):
        want_toks, want_logits = hf_greedy(hf, prompt, n)
        assert s.out == want_toks, f"prompt of {len(prompt)} tokens diverged"
        torch.testing.assert_close(torch.stack(s.logits), want_logits, atol=ATOL, rtol=0)


@pytest.fixture(scope="module")
def models(tiny_dir: Path) -> tuple:
    model, cfg = load_model(tiny_dir, progress=False)
    return model, cfg, load_hf(tiny_dir)


def test_batched_greedy_matches_hf(models: tuple) -> None:
    model, cfg, hf = models
    prompts = _prompts([1, 5, 17, 40], cfg.vocab_size)
    runner = PagedGreedy(model, cfg)
    seqs = [runner.new_seq(p, MAX_NEW) for p in prompts]
    runner.run(seqs, MAX_NEW)
    _check_against_hf(hf, seqs, prompts, MAX_NEW)


def test_chunked_prefill_matches_hf(models: tuple) -> None:
    """Chunks of 7: the 3-token prompt decodes while the others still prefill."""
    model, cfg, hf = models
    prompts = _prompts([3, 13, 20], cfg.vocab_size, seed=1)
    runner = PagedGreedy(model, cfg)
    seqs = [runner.new_seq(p, MAX_NEW) for p in prompts]
    runner.run(seqs, MAX_NEW, chunk=7)
    _check_against_hf(hf, seqs, prompts, MAX_NEW)


def test_prefix_cache_matches_hf(models: tuple) -> None:
    """B reuses A's first 3 pages (12 tokens) and prefills only its own suffix."""
    model, cfg, hf = models
    prefix, suf_a, suf_b, fresh = _prompts([12, 5, 9, 6], cfg.vocab_size, seed=2)
    runner = PagedGreedy(model, cfg, page_size=4)
    a = runner.new_seq(prefix + suf_a, 8)
    runner.run([a], 8)
    b = runner.new_seq(prefix + suf_b, MAX_NEW, share=a, shared_tokens=12)
    c = runner.new_seq(fresh, MAX_NEW)
    runner.run([b, c], MAX_NEW)
    _check_against_hf(hf, [a], [prefix + suf_a], 8)
    _check_against_hf(hf, [b, c], [prefix + suf_b, fresh], MAX_NEW)


@pytest.fixture(scope="module")
def smol(smol_dir: Path) -> dict:
    """Both models on the converted default model, plus a cache of HF greedy results."""
    from transformers import AutoTokenizer

    model, cfg = load_model(smol_dir, progress=False)
    return {"model": model, "cfg": cfg, "hf": load_hf(smol_dir), "tok": AutoTokenizer.from_pretrained(smol_dir)}


@pytest.mark.parametrize("chunk", [None, 16])
def test_smollm2_matches_hf(smol: dict, chunk: int | None) -> None:
    """The converted default model: mixed-length text prompts, batched, optionally chunked."""
    texts = ["The quick brown fox", "In 1492, Columbus", "def fibonacci(n):\n    " * 3]
    prompts = [smol["tok"](t)["input_ids"] for t in texts]
    runner = PagedGreedy(smol["model"], smol["cfg"], page_size=16)
    seqs = [runner.new_seq(p, MAX_NEW) for p in prompts]
    runner.run(seqs, MAX_NEW, chunk=chunk)
    if "refs" not in smol:  # the HF reference is the slow half: compute it once for both variants
        smol["refs"] = [hf_greedy(smol["hf"], p, MAX_NEW) for p in prompts]
    for s, (want_toks, want_logits) in zip(seqs, smol["refs"], strict=True):
        assert s.out == want_toks
        torch.testing.assert_close(torch.stack(s.logits), want_logits, atol=ATOL, rtol=0)


def test_smollm2_chat_france(smol: dict) -> None:
    """Greedy on the chat-templated question equals transformers' greedy, up to the eos."""
    tok, cfg = smol["tok"], smol["cfg"]
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    stop = set(cfg.eos_token_ids)
    runner = PagedGreedy(smol["model"], cfg, page_size=16)
    seq = runner.new_seq(prompt, 48)
    runner.run([seq], 48, stop=stop)
    want, _ = hf_greedy(smol["hf"], prompt, 48, stop=stop)
    assert seq.out == want
    assert seq.out[-1] in stop
    assert "Paris" in tok.decode(seq.out)
