"""Deterministic inference (--enable-deterministic-inference, engine/layers/batch_invariant.py):
a request's tokens and logprobs are identical bit for bit alone, in a batch of mixed requests,
behind a cached prefix of any length, at any prefill chunk size and with overlap on or off.
In bfloat16 (where reduction order shows most) and float32, on the default model, in process
(LocalEngine: the served Step stream and runner without sockets)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from engine.config import ServerConfig
from engine.layers import batch_invariant
from engine.local import LocalEngine, Result
from msgs.params import SamplingParams

GREEDY = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True, logprobs=True)
SAMPLED = SamplingParams(max_new_tokens=4, temperature=0.8, seed=11, ignore_eos=True, logprobs=True)


def _prompt(n: int, salt: int = 0) -> list[int]:
    return [(7 * i + 13 * salt) % 40000 + 100 for i in range(n)]


PROMPT = _prompt(150)
OTHERS = [_prompt(n, s) for s, n in enumerate((3, 40, 97, 16, 200, 1, 65), start=1)]


def _engine(model: Path, dtype: str, **kw) -> LocalEngine:  # noqa: ANN003
    return LocalEngine(ServerConfig(model=str(model), dtype=dtype, enable_deterministic_inference=True,
                                    max_total_tokens=8192, max_running_requests=16, **kw))


def _key(r: Result) -> tuple[list[int], list[float]]:
    assert r.finish_reason == "length", r
    return r.output_ids, r.logprobs


@pytest.fixture(scope="module")
def fresh(default_model_dir: Path) -> Callable[[str], tuple[LocalEngine, Result]]:
    """An engine of a dtype and PROMPT's greedy answer in it, alone in the fresh engine (its first
    request): test_one_request_one_answer goes on in that engine, and the chunked runs take the
    bfloat16 answer as their reference (one engine start and one prefill for both)."""
    made: dict[str, tuple[LocalEngine, Result]] = {}

    def get(dtype: str) -> tuple[LocalEngine, Result]:
        if dtype not in made:
            eng = _engine(default_model_dir, dtype)
            made[dtype] = eng, eng.generate([PROMPT], GREEDY)[0]
        return made[dtype]

    return get


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_one_request_one_answer(fresh: Callable[[str], tuple[LocalEngine, Result]], dtype: str) -> None:
    eng, first = fresh(dtype)
    for params in (GREEDY, SAMPLED):
        (alone,) = [first] if params is GREEDY else eng.generate([PROMPT], params)
        want = _key(alone)
        assert alone.cached_tokens == 0 or params is SAMPLED
        (again,) = eng.generate([PROMPT], params)  # the prompt's pages from the prefix cache
        assert again.cached_tokens >= 128 and _key(again) == want
        mixed = eng.generate([OTHERS[0], PROMPT[:50] + [5], PROMPT, *OTHERS[1:]], params)
        assert _key(mixed[2]) == want, "in a batch of mixed requests"
    for cut in (16, 96, 144):  # a cached prefix of every length, the cache emptied before each
        eng.flush()
        eng.generate([PROMPT[:cut]], SamplingParams(max_new_tokens=1))
        (hit,) = eng.generate([PROMPT], SAMPLED)
        assert hit.cached_tokens == cut // 16 * 16 and _key(hit) == _key(eng.generate([PROMPT], SAMPLED)[0])
        assert _key(hit) == want, f"behind {hit.cached_tokens} cached tokens"


def test_engines_of_both_modes_in_one_process(default_model_dir: Path,
                                              fresh: Callable[[str], tuple[LocalEngine, Result]]) -> None:
    """The layers read the mode from one process-wide switch; each runner sets it to its own at a
    step, so an engine built later with the mode off (which turned the switch off) leaves this
    engine's answers as they were, and runs with the mode off itself."""
    eng, first = fresh("bfloat16")
    off = LocalEngine(ServerConfig(model=str(default_model_dir), dtype="bfloat16", max_total_tokens=4096,
                                   disable_deterministic_inference=True))
    assert not off.runner.deterministic and not batch_invariant.enabled()
    mixed = eng.generate([OTHERS[0], PROMPT, *OTHERS[1:]], GREEDY)
    assert _key(mixed[1]) == _key(first) and batch_invariant.enabled()
    off.generate([PROMPT], GREEDY)
    assert not batch_invariant.enabled()


@pytest.fixture(scope="module")
def alone_bf16(fresh: Callable[[str], tuple[LocalEngine, Result]]) -> Result:
    """PROMPT's greedy answer in bfloat16, alone in a fresh engine: the chunked runs' reference."""
    return fresh("bfloat16")[1]


@pytest.mark.parametrize(("chunk", "overlap"), [(64, True), (128, False), (2048, False)])
def test_chunks_and_overlap(default_model_dir: Path, alone_bf16: Result, chunk: int, overlap: bool) -> None:
    want = alone_bf16
    eng = _engine(default_model_dir, "bfloat16", max_prefill_tokens=chunk, disable_overlap=not overlap)
    got = eng.generate([*OTHERS[:3], PROMPT], GREEDY)[-1]
    assert _key(got) == _key(want)


def test_grouped_bmm_and_row_blocks_keep_the_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA shapes of the mode (batched GEMMs in fixed groups, GEMMs in fixed row blocks),
    run on CPU, where a fixed shape keeps a row's bits: the same values as one call."""
    import torch

    bi = batch_invariant
    torch.manual_seed(0)
    a, b = torch.randn(70, 32, 64), torch.randn(70, 64, 65)
    monkeypatch.setattr(bi, "BMM_GROUP", 16)
    assert torch.equal(bi.bmm(a, b), torch.bmm(a, b))
    monkeypatch.setattr(bi, "ROWS", 64)
    x, w = torch.randn(150, 64), torch.randn(96, 64)

    def linear(a: torch.Tensor) -> torch.Tensor:
        return bi.rows_of(a, lambda b: torch.nn.functional.linear(b, w))

    assert torch.equal(linear(x)[100:], linear(x[100:])) and linear(x).shape == (150, 96)
