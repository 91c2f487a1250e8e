"""prompt_logprobs (vLLM's; completions' echo + logprobs): every prompt token's logprob under the
model, against transformers on the same weights in float32, through chunked prefill (scored
chunks beside unscored requests in one step), behind a prompt already in the prefix cache
(a scored prompt is prefilled whole), with the first output token unchanged."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from engine.config import ServerConfig
from engine.local import LocalEngine
from msgs.params import SamplingParams


def _hf_logprobs(path: Path, ids: list[int]) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_prompt_logprobs_equal_transformers_through_chunks_and_the_cache(tiny: Path) -> None:
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(2, 250, (45,), generator=g).tolist()
    other = torch.randint(2, 250, (30,), generator=g).tolist()
    eng = LocalEngine(ServerConfig(model=str(tiny), dtype="float32", page_size=4, max_prefill_tokens=16,
                                   max_total_tokens=1024))
    plain = SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True)
    first = eng.generate([prompt], plain)[0]  # the prompt now sits in the prefix cache
    scored = SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=3)
    res, beside = eng.generate([prompt, other], [scored, plain])  # 16-token chunks, mixed rows
    ref = _hf_logprobs(tiny, prompt)
    want = ref[:-1].gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)
    assert res.cached_tokens == 0 and res.prompt_logprobs is not None and len(res.prompt_logprobs) == 44
    torch.testing.assert_close(torch.tensor(res.prompt_logprobs), want, atol=1e-4, rtol=1e-4)
    assert res.prompt_top_logprobs is not None and all(len(t) == 3 for t in res.prompt_top_logprobs)
    top_v, top_i = ref[:-1].topk(3, dim=-1)
    assert [[t for t, _ in row] for row in res.prompt_top_logprobs] == top_i.tolist()
    torch.testing.assert_close(torch.tensor([[v for _, v in row] for row in res.prompt_top_logprobs]), top_v,
                               atol=1e-4, rtol=1e-4)
    assert res.output_ids == first.output_ids and beside.prompt_logprobs is None
    only = eng.generate([prompt], SamplingParams(max_new_tokens=1, temperature=0, prompt_logprobs=0))[0]
    assert only.prompt_top_logprobs is None and only.prompt_logprobs is not None
    torch.testing.assert_close(torch.tensor(only.prompt_logprobs), want, atol=1e-4, rtol=1e-4)
    assert eng.core.leak_free()


def test_scores_survive_a_pool_too_small_for_the_batch(tiny: Path) -> None:
    """Scored prompts under memory pressure: requests are retracted and re-prefilled (a scored
    one overwrites what it filed); every prompt's scores still equal transformers', no leak."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 250, (n,), generator=g).tolist() for n in (45, 38, 41, 30)]
    eng = LocalEngine(ServerConfig(model=str(tiny), dtype="float32", page_size=4, max_prefill_tokens=32,
                                   max_total_tokens=48 * 4))
    got = eng.generate(prompts, SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True, prompt_logprobs=0))
    assert eng.core.retractions > 0 and eng.core.leak_free()
    for ids, res in zip(prompts, got, strict=True):
        ref = _hf_logprobs(tiny, ids)
        want = ref[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
        assert res.prompt_logprobs is not None and len(res.output_ids) == 24
        torch.testing.assert_close(torch.tensor(res.prompt_logprobs), want, atol=1e-4, rtol=1e-4)


def test_a_cached_prompt_scored_again_in_a_pool_under_twice_its_size(tiny: Path) -> None:
    """A scored prompt is prefilled whole beside the tree's copy of it: it must not also lock that
    copy (2x the prompt), or a pool under 2x stalls its next chunk and every request after it."""
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(2, 250, (100,), generator=g).tolist()
    eng = LocalEngine(ServerConfig(model=str(tiny), dtype="float32", page_size=4, max_prefill_tokens=16,
                                   max_total_tokens=160, context_length=150))
    scored = SamplingParams(max_new_tokens=1, temperature=0, prompt_logprobs=0)
    first = eng.generate([prompt], scored)[0]
    again = eng.generate([prompt], scored)[0]
    plain = eng.generate([prompt[:60]], SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True))[0]
    assert first.finish_reason and again.finish_reason and plain.finish_reason == "length"
    assert again.prompt_logprobs == first.prompt_logprobs and plain.cached_tokens >= 56
    assert eng.core.leak_free()


def test_prompt_logprobs_with_speculative_decoding(tiny: Path) -> None:
    """With NGRAM speculation a scored prompt's chunks share steps with another request's verify rows
    (drafts of its repetitive prompt): the scores are still transformers', the sampled rows still
    verify, and the tokens are the plain engine's; a max_tokens 0 request answers its scores alone.
    (Refused with a 400 until the forty-sixth session.)"""
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(2, 250, (45,), generator=g).tolist()
    loop = [7, 8, 9, 10, 11] * 3  # NGRAM finds its continuation in its own tokens
    cfg = dict(model=str(tiny), dtype="float32", page_size=4, max_prefill_tokens=16, max_total_tokens=1024)
    plain = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
    scored = SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=2)
    want = LocalEngine(ServerConfig(**cfg)).generate([loop, prompt], [plain, scored])
    eng = LocalEngine(ServerConfig(**cfg, speculative_algorithm="NGRAM"))
    steps = _record_steps(eng)
    looped, res = eng.generate([loop, prompt], [plain, scored])
    assert _verified_last_chunk(steps), "a verify step scored the prompt's last chunk and sampled it"
    assert [looped.output_ids, res.output_ids] == [w.output_ids for w in want]
    ref = _hf_logprobs(tiny, prompt)
    expect = ref[:-1].gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)
    assert res.prompt_logprobs is not None and len(res.prompt_logprobs) == 44
    torch.testing.assert_close(torch.tensor(res.prompt_logprobs), expect, atol=1e-4, rtol=1e-4)
    assert res.prompt_top_logprobs is not None
    assert [[t for t, _ in row] for row in res.prompt_top_logprobs] == ref[:-1].topk(2, dim=-1).indices.tolist()
    steps.clear()  # max_tokens 0: the prompt scored, no token, its last chunk beside verify rows again
    other = torch.randint(2, 250, (30,), generator=torch.Generator().manual_seed(30)).tolist()
    _, only = eng.generate([[10, 11, 12] * 5, other], [plain, SamplingParams(max_new_tokens=0, prompt_logprobs=1)])
    assert _verified_last_chunk(steps)
    assert only.output_ids == [] and only.finish_reason == "length" and only.prompt_logprobs is not None
    ref = _hf_logprobs(tiny, other)
    torch.testing.assert_close(torch.tensor(only.prompt_logprobs),
                               ref[:-1].gather(1, torch.tensor(other[1:])[:, None]).squeeze(1), atol=1e-4, rtol=1e-4)
    assert eng.core.leak_free()


def test_prompt_logprobs_beside_a_draft_tree(tiny: Path) -> None:
    """NGRAM draft trees (--speculative-eagle-topk 3): a scored prompt's last chunk shares its step with
    another request's tree verify row (three continuations of its prompt in the radix tree, so three
    branches at its first verify): the scores are transformers', both answers the plain engine's."""
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(2, 250, (34,), generator=g).tolist()  # chunks 14 + 16 + 4: the last beside the tree
    head = list(range(100, 114))
    cfg = dict(model=str(tiny), dtype="float32", page_size=4, max_prefill_tokens=16, max_total_tokens=1024)
    plain = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    scored = SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=2)
    want = LocalEngine(ServerConfig(**cfg)).generate([head, prompt], [plain, scored])
    eng = LocalEngine(ServerConfig(**cfg, speculative_algorithm="NGRAM", speculative_eagle_topk=3,
                                   speculative_num_draft_tokens=8))
    first = want[0].output_ids[0]
    eng.generate([head + [first, b, b + 1] for b in (20, 30, 40)], SamplingParams(max_new_tokens=1, temperature=0))
    steps = _record_steps(eng)
    got = eng.generate([head, prompt], [plain, scored])
    assert _verified_last_chunk(steps, trees=True), "a tree verify step scored the prompt's last chunk"
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    ref = _hf_logprobs(tiny, prompt)
    res = got[1]
    torch.testing.assert_close(torch.tensor(res.prompt_logprobs),
                               ref[:-1].gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1), atol=1e-4, rtol=1e-4)
    assert [[t for t, _ in row] for row in res.prompt_top_logprobs] == ref[:-1].topk(2, dim=-1).indices.tolist()
    assert eng.core.leak_free()


def test_prompt_scored_alone_when_a_chunk_ends_one_token_short(tiny: Path) -> None:
    """max_tokens 0 (echo + logprobs): a 17-token prompt in 16-token chunks leaves one prompt token,
    which a decode row would feed; such a request has none, so its prefill takes it (it waited for
    good, its pages held, until the forty-sixth session)."""
    prompt = list(range(20, 37))
    eng = LocalEngine(ServerConfig(model=str(tiny), dtype="float32", page_size=4, max_prefill_tokens=16,
                                   max_total_tokens=1024))
    res = eng.generate([prompt], SamplingParams(max_new_tokens=0, prompt_logprobs=1))[0]
    assert res.finish_reason == "length" and res.output_ids == []
    ref = _hf_logprobs(tiny, prompt)
    torch.testing.assert_close(torch.tensor(res.prompt_logprobs),
                               ref[:-1].gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1), atol=1e-4, rtol=1e-4)
    assert eng.core.leak_free()


def _record_steps(eng: LocalEngine) -> list:
    """The Steps the engine's scheduler plans from now on (appended as planned)."""
    steps: list = []
    plan = eng.core.plan

    def record():  # noqa: ANN202
        step = plan()
        steps.append(step)
        return step

    eng.core.plan = record  # type: ignore[method-assign]
    return steps


def _verified_last_chunk(steps: list, trees: bool = False) -> bool:
    """Whether a step verified drafts (a branching tree, with `trees`) and, in the same forward,
    scored a prompt chunk that samples."""
    from msgs.codec import unpack_ids

    for step in steps:
        f = step.forward if step is not None else None
        if f is not None and f.drafts is not None and f.prompt is not None:
            if trees and not any(p != i - 1 for i, p in enumerate(unpack_ids(f.drafts.parents))):
                continue
            sample = unpack_ids(f.sample)
            if any(sample[i] for i in unpack_ids(f.prompt.rows)):
                return True
    return False
