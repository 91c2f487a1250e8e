"""Tests for the batched token sampler (run on CPU, and on CUDA when available)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from engine.run.noise import _mix64, _mix64_int
from engine.run.ranking import canonical_topk, ranked_topk
from engine.run.sample_params import SampleParams
from engine.run.sampler import Sampler

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    return torch.device(request.param)


def _sampler(device: torch.device, vocab: int = 16, slots: int = 8) -> Sampler:
    return Sampler(vocab, slots, device)


def _pos(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def _draw(s: Sampler, logits: torch.Tensor, slot: int, n: int, device: torch.device) -> torch.Tensor:
    """n draws for one slot: the same logits row at positions 0..n-1, in one batch."""
    rows = logits.to(device).expand(n, -1).contiguous()
    return s.sample(rows, [slot] * n, torch.arange(n, device=device)).token_ids.cpu()


def test_hash_matches_host_splitmix64(device: torch.device) -> None:
    rng = random.Random(0)
    vals = [rng.getrandbits(64) - (1 << 63) for _ in range(2000)] + [-(1 << 63), (1 << 63) - 1, 0, -1]
    got = _mix64(torch.tensor(vals, device=device)).cpu().tolist()
    assert got == [_mix64_int(v) for v in vals]


# ---- greedy ----


def test_greedy_is_argmax(device: torch.device) -> None:
    s = _sampler(device, vocab=1000)
    for slot in range(5):
        s.add(slot, SampleParams(seed=slot, temperature=0.0))
    logits = torch.randn(5, 1000, device=device)
    res = s.sample(logits, [0, 1, 2, 3, 4], _pos([3, 9, 0, 1, 2], device))
    assert torch.equal(res.token_ids, logits.argmax(-1))
    assert res.token_ids.dtype == torch.int64 and res.token_ids.device.type == device.type
    assert res.logprobs is None and res.top_ids is None and res.top_logprobs is None


def test_zero_temperature_rows_stay_greedy_in_mixed_batch(device: torch.device) -> None:
    s = _sampler(device, vocab=50)
    temps = [0.0, 1.5, 0.0, 1.0]
    for slot, t in enumerate(temps):
        s.add(slot, SampleParams(seed=100 + slot, temperature=t, top_p=0.99 if slot == 3 else 1.0))
    torch.manual_seed(0)
    non_argmax = 0
    for step in range(50):
        logits = torch.randn(4, 50, device=device) * 0.3  # flat: sampled rows rarely hit argmax
        tok = s.sample(logits, [0, 1, 2, 3], _pos([step] * 4, device)).token_ids
        best = logits.argmax(-1)
        assert tok[0] == best[0] and tok[2] == best[2]
        non_argmax += int((tok[1] != best[1]).item()) + int((tok[3] != best[3]).item())
    assert non_argmax > 50  # the sampled rows really sampled


# ---- seeded reproducibility ----


def test_same_seed_and_position_give_same_token_in_any_batch(device: torch.device) -> None:
    vocab = 64
    params = {
        0: SampleParams(seed=7, temperature=1.0, top_k=20),  # alone: top-k candidate path
        1: SampleParams(seed=8, temperature=0.9),  # no filter: full-vocab path
        2: SampleParams(seed=9, temperature=1.2, top_p=0.9),  # forces the sort path
        3: SampleParams(seed=10, temperature=0.0),
    }
    torch.manual_seed(1)
    row_logits = {slot: torch.randn(vocab, device=device) for slot in params}

    def run(sampler: Sampler, slots: list[int], positions: list[int]) -> dict[int, int]:
        logits = torch.stack([row_logits[s] for s in slots])
        tok = sampler.sample(logits, slots, _pos(positions, device)).token_ids.tolist()
        return dict(zip(slots, tok, strict=True))

    a, b = _sampler(device, vocab), _sampler(device, vocab)
    for slot, p in params.items():
        a.add(slot, p)
        b.add(slot, p)
    for pos in range(40):
        alone = {slot: run(a, [slot], [pos])[slot] for slot in params}
        full = run(a, [0, 1, 2, 3], [pos] * 4)
        reordered = run(b, [2, 3, 0, 1], [pos] * 4)
        pairs = {**run(b, [1, 0], [pos, pos]), **run(b, [3, 2], [pos, pos])}
        assert alone == full == reordered == pairs


def test_position_not_step_count_determines_noise(device: torch.device) -> None:
    s = _sampler(device, vocab=100)
    s.add(0, SampleParams(seed=5, temperature=1.0))
    logits = torch.zeros(1, 100, device=device)
    first = [s.sample(logits, [0], _pos([p], device)).token_ids.item() for p in range(30)]
    again = [s.sample(logits, [0], _pos([p], device)).token_ids.item() for p in reversed(range(30))]
    assert first == list(reversed(again))
    assert len(set(first)) > 15  # positions decorrelate


def test_different_seeds_give_different_tokens(device: torch.device) -> None:
    s = _sampler(device, vocab=100)
    s.add(0, SampleParams(seed=1, temperature=1.0))
    s.add(1, SampleParams(seed=2, temperature=1.0))
    s.add(2, SampleParams(seed=1, temperature=1.0))
    logits = torch.zeros(3, 100, device=device)
    same, diff = 0, 0
    for pos in range(300):
        tok = s.sample(logits, [0, 1, 2], _pos([pos] * 3, device)).token_ids.tolist()
        same += tok[0] == tok[2]
        diff += tok[0] != tok[1]
    assert same == 300
    assert diff > 280  # uniform over 100 tokens: ~1% collisions expected


# ---- distribution ----


def _chi_square(counts: torch.Tensor, probs: torch.Tensor, n: int) -> float:
    expected = probs * n
    keep = expected > 0
    return float((((counts - expected) ** 2)[keep] / expected[keep]).sum())


def test_samples_follow_softmax_with_temperature(device: torch.device) -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -2.0])
    n, temp = 20000, 0.7
    s = _sampler(device, vocab=6)
    s.add(0, SampleParams(seed=1234, temperature=temp))
    tok = _draw(s, logits, 0, n, device)
    counts = torch.bincount(tok, minlength=6).double()
    probs = torch.softmax(logits.double() / temp, -1)
    # 5 degrees of freedom; 25 is the p~1e-4 critical value.
    assert _chi_square(counts, probs, n) < 25.0


def test_top_k_keeps_only_best_and_renormalises(device: torch.device) -> None:
    logits = torch.tensor([0.1, 1.0, -0.5, 0.9, 0.0, 0.2, -1.0, 0.3])
    n = 20000
    s = _sampler(device, vocab=8)
    s.add(0, SampleParams(seed=3, temperature=1.0, top_k=2))
    counts = torch.bincount(_draw(s, logits, 0, n, device), minlength=8).double()
    assert set(torch.nonzero(counts).flatten().tolist()) == {1, 3}
    probs = torch.zeros(8, dtype=torch.float64)
    probs[[1, 3]] = torch.softmax(logits[[1, 3]].double(), -1)
    assert _chi_square(counts, probs, n) < 15.0  # 1 dof


def test_top_p_excludes_tail_per_row(device: torch.device) -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    n = 4000
    s = _sampler(device, vocab=4)
    s.add(0, SampleParams(seed=11, temperature=1.0, top_p=0.75))
    s.add(1, SampleParams(seed=12, temperature=1.0))
    rows = logits.to(device).expand(2 * n, -1)
    slots = [0] * n + [1] * n
    tok = s.sample(rows, slots, torch.arange(2 * n, device=device) % n).token_ids.cpu()
    assert set(tok[:n].tolist()) == {0, 1}  # mass before token 2 is 0.8 >= 0.75
    assert set(tok[n:].tolist()) == {0, 1, 2, 3}  # the unfiltered row in the same batch keeps the tail
    kept = torch.bincount(tok[:n], minlength=4).double()
    assert _chi_square(kept, torch.tensor([0.625, 0.375, 0, 0], dtype=torch.float64), n) < 15.0


def test_min_p_excludes_tokens_below_fraction_of_max(device: torch.device) -> None:
    probs = torch.tensor([0.5, 0.3, 0.12, 0.05, 0.03])
    s = _sampler(device, vocab=5)
    s.add(0, SampleParams(seed=21, temperature=1.0, min_p=0.2))  # threshold 0.1
    tok = _draw(s, probs.log(), 0, 5000, device)
    assert set(tok.tolist()) == {0, 1, 2}


def test_top_k_and_top_p_combine(device: torch.device) -> None:
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    s = _sampler(device, vocab=4)
    # top_k=3 renormalises to [4/9, 3/9, 2/9]; top_p=0.7 then keeps tokens 0 and 1 (mass 7/9).
    s.add(0, SampleParams(seed=2, temperature=1.0, top_k=3, top_p=0.7))
    assert set(_draw(s, probs.log(), 0, 3000, device).tolist()) == {0, 1}


# ---- penalties ----


def _force(s: Sampler, slot: int, token: int, position: int, vocab: int, device: torch.device) -> None:
    """Make `slot` emit `token` (a large one-hot logit beats any penalty here)."""
    logits = torch.zeros(1, vocab, device=device)
    logits[0, token] = 100.0
    assert s.sample(logits, [slot], _pos([position], device)).token_ids.item() == token


def test_repetition_penalty_matches_transformers(device: torch.device) -> None:
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    vocab, prompt, generated = 32, [1, 2, 3, 5, 2], [7, 9, 7]
    s = _sampler(device, vocab)
    s.add(0, SampleParams(seed=0, temperature=0.0, repetition_penalty=1.3), prompt)
    s.add(1, SampleParams(seed=0, temperature=1.0))  # neighbour without penalties
    for i, t in enumerate(generated):
        _force(s, 0, t, len(prompt) + i, vocab, device)
    torch.manual_seed(2)
    logits = torch.randn(2, vocab) * 3
    got = s.apply_penalties(logits.to(device), [0, 1]).cpu()
    ref = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt + generated]), logits[:1].clone())
    torch.testing.assert_close(got[:1], ref)
    assert torch.equal(got[1], logits[1])
    seen = set(prompt + generated)
    assert all(got[0, i] < logits[0, i] for i in seen if logits[0, i] != 0)


def test_frequency_and_presence_penalties_follow_openai(device: torch.device) -> None:
    vocab, freq, pres = 16, 0.5, 0.3
    s = _sampler(device, vocab)
    s.add(2, SampleParams(seed=0, temperature=0.0, frequency_penalty=freq, presence_penalty=pres), [4, 4])
    for i, t in enumerate([7, 7, 9, 7]):
        _force(s, 2, t, i, vocab, device)
    counts = torch.zeros(vocab)
    counts[7], counts[9] = 3, 1  # prompt tokens (4) do not count for OpenAI penalties
    logits = torch.randn(1, vocab)
    got = s.apply_penalties(logits.to(device), [2]).cpu()
    torch.testing.assert_close(got, logits - counts * freq - (counts > 0).float() * pres)


def test_penalties_change_greedy_choice_and_reset_on_reuse(device: torch.device) -> None:
    vocab = 8
    s = _sampler(device, vocab)
    s.add(0, SampleParams(seed=0, temperature=0.0, presence_penalty=2.0))
    logits = torch.tensor([[0.0, 1.0, 0.5, 0, 0, 0, 0, 0]], device=device)
    assert s.sample(logits, [0], _pos([0], device)).token_ids.item() == 1
    assert s.sample(logits, [0], _pos([1], device)).token_ids.item() == 2  # 1.0 - 2.0 < 0.5
    s.remove(0)
    s.add(0, SampleParams(seed=0, temperature=0.0, presence_penalty=2.0))
    assert s.sample(logits, [0], _pos([0], device)).token_ids.item() == 1  # fresh counts


def test_logit_bias_moves_greedy_and_sampled_rows_and_clears_on_reuse(device: torch.device) -> None:
    vocab = 50
    s = _sampler(device, vocab)
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(3)).to(device)
    top = int(logits.argmax())
    s.add(0, SampleParams(seed=0, temperature=0.0, logit_bias=((7, 100.0),)))  # forces token 7
    s.add(1, SampleParams(seed=1, temperature=0.0, logit_bias=((top, -100.0),)))  # bans the argmax
    s.add(2, SampleParams(seed=2, temperature=0.0))  # no bias, in the same batch
    s.add(3, SampleParams(seed=3, temperature=1.0, logit_bias=((9, 100.0),)))  # sampled: 9 every time
    rows = logits.expand(4, -1).contiguous()
    res = s.sample(rows, [0, 1, 2, 3], _pos([0, 0, 0, 0], device))
    second = int(logits[0].topk(2).indices[1])
    assert res.token_ids.tolist() == [7, second, top, 9]
    assert torch.equal(_draw(s, logits, 3, 64, device), torch.full((64,), 9))
    verify = s.sample_verify(rows[:2], [0, 1], [5, 5], [[], [3]])  # speculative verify rows too
    assert verify.token_ids.tolist() == [7, second]
    s.remove(0)
    s.add(0, SampleParams(seed=0, temperature=0.0))  # the slot's old bias row is cleared
    assert s.sample(logits, [0], _pos([0], device)).token_ids.item() == top
    with pytest.raises(ValueError, match="logit_bias"):
        s.add(4, SampleParams(seed=0, logit_bias=((vocab, 1.0),)))


def test_logit_bias_leaves_logprobs_raw(device: torch.device) -> None:
    vocab = 30
    s = _sampler(device, vocab)
    s.add(0, SampleParams(seed=0, temperature=0.0, logprobs=True, logit_bias=((4, 50.0),)))
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(5)).to(device)
    res = s.sample(logits, [0], _pos([0], device))
    assert res.token_ids.item() == 4
    torch.testing.assert_close(res.logprobs.cpu(), torch.log_softmax(logits.float(), -1)[:, 4].cpu())


def test_min_new_tokens_masks_stop_ids_below_its_position_only(device: torch.device) -> None:
    """A row sampled below prompt length + min_new_tokens cannot draw its min_stop_ids (greedy,
    sampled and verify rows); from that position on it can; other rows and logprobs are untouched."""
    vocab = 40
    s = _sampler(device, vocab)
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(7)).to(device)
    top, second = logits[0].topk(2).indices.tolist()
    s.add(0, SampleParams(seed=0, temperature=0.0, logprobs=True, min_new_tokens=3, min_stop_ids=(top, 5)),
          prompt_ids=[1, 2, 3, 4])  # outputs 0..2 sit at positions 4..6
    s.add(1, SampleParams(seed=1, temperature=0.0))  # the same logits, no minimum
    rows = logits.expand(2, -1).contiguous()
    for pos, want in ((4, second), (6, second), (7, top), (90, top)):
        res = s.sample(rows, [0, 1], _pos([pos, pos], device))
        assert res.token_ids.tolist() == [want, top], pos
        torch.testing.assert_close(res.logprobs[0].cpu(), torch.log_softmax(logits.float(), -1)[0, want].cpu())
    verify = s.sample_verify(rows[:1].expand(3, -1), [0, 0, 0], [5, 6, 7], [[], [9], [9, 9]])
    assert verify.token_ids.tolist() == [second, second, top]
    hot = torch.full((1, vocab), -5.0, device=device)
    hot[0, top] = 5.0  # sampled: the stop token holds ~all the mass, yet never drawn below the line
    s.add(2, SampleParams(seed=2, temperature=1.0, min_new_tokens=2, min_stop_ids=(top,)), prompt_ids=[1])
    drawn = [s.sample(hot, [2], _pos([p], device)).token_ids.item() for p in (1, 2, 3, 3)]
    assert top not in drawn[:2] and drawn[2:] == [top, top]


def test_min_stop_rows_widen_and_clear_on_reuse(device: torch.device) -> None:
    vocab = 300
    s = _sampler(device, vocab)
    logits = torch.arange(vocab, dtype=torch.float32, device=device).unsqueeze(0)  # argmax: the last id
    s.add(0, SampleParams(seed=0, temperature=0.0, min_new_tokens=5, min_stop_ids=(299,)))
    s.add(1, SampleParams(seed=1, temperature=0.0, min_new_tokens=5, min_stop_ids=tuple(range(260, 300))))
    res = s.sample(logits.expand(2, -1).contiguous(), [0, 1], _pos([0, 0], device))  # 40 ids: rows widened
    assert res.token_ids.tolist() == [298, 259]
    s.remove(1)
    s.add(1, SampleParams(seed=1, temperature=0.0))  # the reused slot's old stop row is cleared
    assert s.sample(logits, [1], _pos([0], device)).token_ids.item() == 299
    with pytest.raises(ValueError, match="min_stop_ids"):
        s.add(2, SampleParams(seed=0, min_new_tokens=1, min_stop_ids=(vocab,)))


def test_allowed_token_ids_restrict_greedy_sampled_and_verify_rows(device: torch.device) -> None:
    """vLLM's allowed_token_ids: a row draws among its set only (greedy: the best of it; sampled:
    never outside it, with top_k / top_p over what is left), a bias or penalty cannot bring a masked
    token back, rows without a set and logprobs are untouched, a set containing the padding's id 0
    keeps it, and a reused slot forgets its set."""
    vocab = 64
    s = _sampler(device, vocab)
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(9)).to(device)
    order = logits[0].argsort(descending=True).tolist()
    top = order[0]
    allowed = tuple(sorted(order[5:9]))  # four tokens, none of the best five
    best_allowed = max(allowed, key=lambda t: logits[0, t].item())
    s.add(0, SampleParams(seed=0, temperature=0.0, logprobs=True, allowed_token_ids=allowed))
    s.add(1, SampleParams(seed=1, temperature=0.0))  # no set, the same batch
    s.add(2, SampleParams(seed=2, temperature=0.0, allowed_token_ids=allowed, logit_bias=((top, 100.0),)))
    s.add(3, SampleParams(seed=3, temperature=0.0, allowed_token_ids=(0, order[-1])))  # id 0 is also padding
    rows = logits.expand(4, -1).contiguous()
    res = s.sample(rows, [0, 1, 2, 3], _pos([0, 0, 0, 0], device))
    worst_two = max((0, order[-1]), key=lambda t: logits[0, t].item())
    assert res.token_ids.tolist() == [best_allowed, top, best_allowed, worst_two]
    torch.testing.assert_close(res.logprobs[0].cpu(), torch.log_softmax(logits.float(), -1)[0, best_allowed].cpu())
    verify = s.sample_verify(rows[:2], [0, 1], [5, 5], [[], [3]])
    assert verify.token_ids.tolist() == [best_allowed, top]
    s.add(4, SampleParams(seed=4, temperature=1.0, allowed_token_ids=allowed))
    s.add(5, SampleParams(seed=5, temperature=1.0, top_k=2, allowed_token_ids=allowed))
    drawn, two = _draw(s, logits, 4, 200, device).tolist(), _draw(s, logits, 5, 200, device).tolist()
    assert set(drawn) <= set(allowed) and len(set(drawn)) > 1
    assert set(two) <= set(sorted(allowed, key=lambda t: -logits[0, t].item())[:2])
    s.remove(0)
    s.add(0, SampleParams(seed=0, temperature=0.0))  # the slot's old set is cleared
    assert s.sample(logits, [0], _pos([0], device)).token_ids.item() == top
    with pytest.raises(ValueError, match="allowed_token_ids"):
        s.add(6, SampleParams(seed=0, allowed_token_ids=(vocab,)))


def test_bad_words_follow_the_rows_history(device: torch.device) -> None:
    """vLLM's bad_words as token sequences: a one-token word is never drawn, a pair's second token
    never right after its first (greedy alternates, a sampled row never makes the pair), a verify
    row's drafts count as history, answered tokens recorded with repeats advance it, a retracted
    request's earlier output seeds it, rows without words keep their argmax, a reused slot forgets."""
    vocab = 16
    s = _sampler(device, vocab)
    logits = torch.arange(vocab, 0, -1, dtype=torch.float32, device=device).unsqueeze(0)  # 0 best, then 1, 2
    words = ((0,), (1, 1))
    s.add(0, SampleParams(seed=0, temperature=0.0, bad_words_ids=words))
    s.add(1, SampleParams(seed=1, temperature=0.0))
    got = [s.sample(logits.expand(2, -1), [0, 1], _pos([i, i], device)).token_ids.tolist() for i in range(4)]
    assert got == [[1, 0], [2, 0], [1, 0], [2, 0]]
    verify = s.sample_verify(logits.expand(3, -1), [0, 0, 0], [4, 5, 6], [[], [1], [1, 2]])
    assert verify.token_ids.tolist() == [1, 2, 1]  # (the history ends with 2, then 1, then 2)
    s.record(_pos([0, 0], device), _pos([2, 1], device))
    assert s.sample(logits, [0], _pos([7], device)).token_ids.item() == 2
    s.add(2, SampleParams(seed=2, temperature=0.0, bad_words_ids=words), output_ids=[3, 1])
    assert s.sample(logits, [2], _pos([9], device)).token_ids.item() == 2
    s.add(3, SampleParams(seed=3, temperature=2.0, bad_words_ids=words))
    drawn = [s.sample(logits, [3], _pos([i], device)).token_ids.item() for i in range(300)]
    assert 0 not in drawn and all(drawn[i:i + 2] != [1, 1] for i in range(len(drawn))) and drawn.count(1) > 10
    s.remove(0)
    s.add(0, SampleParams(seed=0, temperature=0.0))
    assert s.sample(logits, [0], _pos([0], device)).token_ids.item() == 0


# ---- logprobs ----


def test_logprobs_are_raw_log_softmax_at_chosen_token(device: torch.device) -> None:
    vocab = 40
    s = _sampler(device, vocab)
    s.add(0, SampleParams(seed=1, temperature=0.8, logprobs=True, top_logprobs=3, repetition_penalty=1.5),
          [0, 1, 2])
    s.add(1, SampleParams(seed=2, temperature=0.0, logprobs=True, top_logprobs=5))
    s.add(2, SampleParams(seed=3, temperature=1.0))
    torch.manual_seed(4)
    for pos in range(5):
        logits = torch.randn(3, vocab, device=device) * 2
        res = s.sample(logits, [0, 1, 2], _pos([pos] * 3, device))
        ref = torch.log_softmax(logits, -1)
        assert res.logprobs is not None and res.top_ids is not None and res.top_logprobs is not None
        torch.testing.assert_close(res.logprobs, ref.gather(1, res.token_ids[:, None]).squeeze(1))
        assert res.top_ids.shape == (3, 5) and res.top_logprobs.shape == (3, 5)
        assert torch.all(res.top_logprobs[:, :-1] >= res.top_logprobs[:, 1:])
        torch.testing.assert_close(res.top_logprobs, ref.gather(1, res.top_ids))
        torch.testing.assert_close(res.top_logprobs, ref.topk(5, -1).values)


def test_logprobs_without_top_logprobs(device: torch.device) -> None:
    s = _sampler(device, vocab=10)
    s.add(0, SampleParams(seed=1, temperature=0.0, logprobs=True))
    logits = torch.randn(1, 10, device=device)
    res = s.sample(logits, [0], _pos([0], device))
    assert res.top_ids is None and res.top_logprobs is None
    torch.testing.assert_close(res.logprobs, torch.log_softmax(logits, -1).max(-1).values)


# ---- bookkeeping and validation ----


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},
        {"temperature": float("nan")},
        {"top_p": 0.0},
        {"top_p": 1.01},
        {"top_k": 2.5},
        {"min_p": -0.1},
        {"min_p": 1.5},
        {"repetition_penalty": 0.0},
        {"frequency_penalty": 2.5},
        {"presence_penalty": -2.1},
        {"logprobs": 1},
        {"logprobs": True, "top_logprobs": 21},
        {"logprobs": True, "top_logprobs": -1},
        {"top_logprobs": 2},  # requires logprobs=True
        {"seed": 1.0},
        {"seed": True},
        {"logit_bias": ((1, 101.0),)},
        {"logit_bias": ((-1, 1.0),)},
        {"logit_bias": ((1, float("nan")),)},
        {"logit_bias": tuple((i, 1.0) for i in range(301))},
        {"min_new_tokens": -1},
        {"min_stop_ids": (-2,)},
    ],
)
def test_param_validation(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        SampleParams(**{"seed": 0, **kwargs})


def test_param_defaults_and_flags() -> None:
    p = SampleParams(seed=-5)
    assert not p.greedy and not p.uses_repetition and not p.uses_freq_presence
    assert SampleParams(seed=0, temperature=0.0).greedy
    assert SampleParams(seed=0, repetition_penalty=1.1).uses_repetition
    assert SampleParams(seed=0, presence_penalty=0.1).uses_freq_presence


def test_slot_errors() -> None:
    s = _sampler(torch.device("cpu"), slots=2)
    s.add(0, SampleParams(seed=0))
    with pytest.raises(ValueError):
        s.add(0, SampleParams(seed=1))
    with pytest.raises(ValueError):
        s.add(2, SampleParams(seed=1))
    with pytest.raises(ValueError):
        s.remove(1)
    with pytest.raises(ValueError):
        s.sample(torch.zeros(1, 16), [1], [0])
    with pytest.raises(ValueError):
        s.sample(torch.zeros(1, 15), [0], [0])


def test_batch_plan_cached_until_membership_changes() -> None:
    s = _sampler(torch.device("cpu"))
    s.add(0, SampleParams(seed=0))
    s.add(1, SampleParams(seed=1))
    first = s._batch([0, 1])
    assert s._batch(torch.tensor([0, 1])) is first
    s.add(2, SampleParams(seed=2))
    assert s._batch([0, 1]) is not first


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("deterministic", [False, True])
def test_cuda_sample_does_not_sync(deterministic: bool) -> None:
    """No host read in a step, deterministic inference's ranked top_k candidates included."""
    dev = torch.device("cuda")
    s = Sampler(5000, 8, dev, deterministic=deterministic)
    s.add(0, SampleParams(seed=1, temperature=0.7, top_p=0.9, min_p=0.01, logprobs=True, top_logprobs=4))
    penalised = SampleParams(seed=2, temperature=0.0, repetition_penalty=1.2, frequency_penalty=0.5)
    s.add(1, penalised, [1, 2, 3])
    s.add(2, SampleParams(seed=3, temperature=1.0, top_k=40))
    logits = torch.randn(3, 5000, device=dev)
    positions = torch.tensor([5, 6, 7], device=dev)
    slots_dev = torch.tensor([0, 1, 2], device=dev)
    expected = s.sample(logits, [0, 1, 2], positions).token_ids
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        s.remove(1)  # re-adding resets the penalty state, so the list call below repeats `expected`
        s.add(1, penalised, [1, 2, 3])
        s.sample(logits, [0, 1, 2], positions)  # cache miss: uploads the slot list
        s.remove(1)
        s.add(1, penalised, [1, 2, 3])
        listed = s.sample(logits, [0, 1, 2], positions).token_ids
        on_device = s.sample(logits, slots_dev, positions).token_ids
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # Each call recorded its token; the penalised row may move, the others must not.
    assert torch.equal(listed, expected)
    assert on_device[0] == expected[0] and on_device[2] == expected[2]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fused_noise_gives_the_torch_ops_tokens() -> None:
    """On CUDA the race's noise is one triton launch (triton_ops.race_noise_); the torch ops of
    `_log_exp_noise` give the same tokens, at every batch size (odd ones too) and mode."""
    dev = torch.device("cuda")
    fused, ops = Sampler(3000, 4, dev), Sampler(3000, 4, dev)
    assert fused._fused_noise
    ops._fused_noise = False
    for s in (fused, ops):
        s.add(0, SampleParams(seed=1, temperature=0.9))
        s.add(1, SampleParams(seed=2, temperature=1.1, top_p=0.8))
        s.add(2, SampleParams(seed=3, temperature=1.0, top_k=30))
    logits = torch.randn(64, 3000, device=dev)
    for slots in ([0], [0] * 7, [1] * 64, [2] * 64, [0, 1, 2, 0] * 16, [2, 1, 0]):
        b = len(slots)
        positions = torch.arange(b, device=dev)
        assert torch.equal(fused.sample(logits[:b], slots, positions).token_ids,
                           ops.sample(logits[:b], slots, positions).token_ids)

def test_ranked_topk_orders_equal_values_by_id_whatever_k() -> None:
    """torch.topk orders equal values arbitrarily and differently for each k (a request's
    top_logprobs changed with the largest top_logprobs of its batch); ranked_topk's top k are the
    first k of one order: value descending, then id ascending."""
    torch.manual_seed(0)
    x = torch.randn(4, 300).bfloat16().float()  # bf16 values: many exact ties
    x[1, :] = 0.5
    x[2, 7] = -math.inf
    for r in range(4):
        want = sorted(range(300), key=lambda i: (-x[r, i].item(), i))
        for k in (1, 3, 20, 64):
            vals, ids = ranked_topk(x[r : r + 1], k)
            assert ids[0].tolist() == want[:k]
            assert torch.equal(vals, x[r : r + 1].gather(1, ids))


def test_top_logprobs_do_not_depend_on_the_batch_on_ties(device: torch.device) -> None:
    """A row of tied logits alone and beside rows that ask for more top_logprobs: the same top ids
    (lowest ids first among equals)."""
    vocab = 64
    row = torch.zeros(1, vocab)
    row[0, 40:] = 1.0  # 24 tied best tokens
    own = SampleParams(seed=5, temperature=0.0, logprobs=True, top_logprobs=3)
    for other in (None, SampleParams(seed=6, logprobs=True, top_logprobs=20),
                  SampleParams(seed=7, logprobs=True, top_logprobs=5, top_p=0.9)):
        s = Sampler(vocab, 4, device)
        s.add(0, own)
        slots = [0] if other is None else [0, 1]
        if other is not None:
            s.add(1, other)
        logits = row.expand(len(slots), -1).contiguous().to(device)
        res = s.sample(logits, slots, _pos([0] * len(slots), device))
        assert res.top_ids[0, :3].tolist() == [40, 41, 42]


def test_canonical_topk_gives_ranked_topk_s_first_row_k() -> None:
    """canonical_topk's float topk, put in ranked order and ranked in full only where the row's
    own k-th value ties past the cut, agrees with ranked_topk on each row's first row_k."""
    torch.manual_seed(1)
    x = (torch.randn(64, 500) * 0.3).bfloat16().float()  # bf16 values: many exact ties
    x[3, :] = 0.25  # every value tied: every cut ties
    x[4, 10:400] = 2.0
    for k in (1, 2, 7, 50, 499, 500):
        row_k = torch.randint(1, k + 1, (64,))
        row_k[::5] = k
        vals, ids = canonical_topk(x, k, row_k)
        want_vals, want_ids = ranked_topk(x, k)
        assert vals.shape == ids.shape == (64, k)
        for r in range(64):
            n = int(row_k[r])
            assert ids[r, :n].tolist() == want_ids[r, :n].tolist(), (k, r)
            assert torch.equal(vals[r, :n], want_vals[r, :n])


def test_ranked_and_canonical_topk_agree_on_nan_and_signed_zeros() -> None:
    """NaN first (as topk and sort put it), -0.0 equal to +0.0 (ordered by id): ranked_topk (a GPU's
    candidates) and canonical_topk (a CPU's) and the stable sort ("sort" mode) agree; a review
    found a NaN misaligning canonical_topk's refill and ranked_topk putting +0.0 before -0.0."""
    x = torch.full((3, 40), 0.5)
    x[0, 30], x[0, 35] = math.nan, 2.0
    x[1] = torch.tensor([-0.0, 0.0, -1.0, -2.0] * 10)
    x[2, ::3] = -math.inf
    for k in (1, 2, 3, 5):
        row_k = torch.full((3,), k)
        vals, ids = canonical_topk(x, k, row_k)
        r_vals, r_ids = ranked_topk(x, k)
        s_vals, s_ids = x.sort(dim=-1, descending=True, stable=True)
        assert ids.tolist() == r_ids.tolist() == s_ids[:, :k].tolist(), k
        for got in (vals, r_vals):
            assert torch.equal(got.nan_to_num(9.0), x.gather(1, ids).nan_to_num(9.0))
    assert ids[0, :2].tolist() == [30, 35] and ids[1, :2].tolist() == [0, 1]


def test_sampled_top_k_does_not_depend_on_the_batch_on_ties(device: torch.device) -> None:
    """Under deterministic inference a top_k row of tied logits draws the same tokens alone and
    beside rows that ask for a larger top_k (a cut through its tie), a top_p alone (full sort) or
    top_logprobs; it keeps its lowest ids among equals, as top_logprobs lists them."""
    vocab = 64
    row = torch.zeros(1, vocab)
    row[0, 40:] = 1.0  # 24 tied best tokens: top_k 3 keeps 40, 41, 42
    own = SampleParams(seed=5, temperature=1.0, top_k=3, top_p=0.9, logprobs=True, top_logprobs=3)
    outs = []
    for other in (None, SampleParams(seed=6, top_k=5), SampleParams(seed=6, top_k=50, logprobs=True, top_logprobs=20),
                  SampleParams(seed=7, top_p=0.9), SampleParams(seed=8, temperature=0.0)):
        s = Sampler(vocab, 4, device, deterministic=True)
        s.add(0, own)
        slots = [0] if other is None else [0, 1]
        if other is not None:
            s.add(1, other)
        logits = row.expand(len(slots), -1).contiguous().to(device)
        tokens = []
        for pos in range(16):
            res = s.sample(logits, slots, _pos([pos] * len(slots), device))
            tokens.append(int(res.token_ids[0]))
            assert res.top_ids[0, :3].tolist() == [40, 41, 42]
        assert set(tokens) <= {40, 41, 42} and len(set(tokens)) > 1
        outs.append(tokens)
    assert all(o == outs[0] for o in outs)


def test_a_cpu_sort_mode_batch_draws_what_the_full_sort_draws(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU, "sort" mode races a row over its first _SORT_FIRST candidates where its survivors
    lie there, over its whole row unsorted where nothing is filtered, and sorts only the rest: the
    same tokens, bit for bit, as sorting every row (rows of each kind, ties, min_p, greedy)."""
    from engine.run import sampler as sampler_mod

    vocab = 5000
    torch.manual_seed(3)
    logits = (torch.randn(10, vocab) * 4).bfloat16().float()
    logits[1] = 0.0  # flat: top_p 0.9 needs 4,500 tokens, past the first 1,024: sorted whole
    logits[4, :50] = 30.0  # 50 tied best
    params = [SampleParams(seed=1, temperature=0.8, top_p=0.9),
              SampleParams(seed=2, temperature=1.0, top_p=0.9),
              SampleParams(seed=3, temperature=0.7),  # nothing filtered: the whole row
              SampleParams(seed=4, temperature=1.0, top_k=2000, top_p=0.95),  # top_k past 1,024
              SampleParams(seed=5, temperature=1.3, top_k=20, top_p=0.5),
              SampleParams(seed=6, temperature=1.0, min_p=0.05, top_p=0.99),
              SampleParams(seed=7, temperature=0.0),
              SampleParams(seed=8, temperature=1.0, top_k=vocab + 10, top_p=0.8),  # top_k past the vocab
              SampleParams(seed=9, temperature=2.0, top_k=-1, top_p=0.3, logprobs=True, top_logprobs=2),
              # top_k past the first 1,024 with top_p: its mass is of its first 2,000, so it is sorted
              # (an audit: raced over 1,024 against their own total, it drew from too few)
              SampleParams(seed=10, temperature=4.0, top_k=2000, top_p=0.6)]

    def draws() -> list[list[int]]:
        s = Sampler(vocab, 16, "cpu", deterministic=True)
        for slot, p in enumerate(params):
            s.add(slot, p)
        slots = list(range(len(params)))
        return [s.sample(logits, slots, torch.full((len(slots),), pos)).token_ids.tolist() for pos in range(12)]

    by_rows = draws()
    monkeypatch.setattr(sampler_mod, "_SORT_FIRST", 10**9)  # every row sorted whole
    assert draws() == by_rows
    assert len({d[1] for d in by_rows}) > 1 and all(d[6] == int(logits[6].argmax()) for d in by_rows)


@pytest.mark.parametrize("top_k", [40, 2000])
def test_a_top_p_row_draws_the_same_beside_any_neighbour_on_a_cpu(top_k: int) -> None:
    """A top_k + top_p row alone ("topk" mode) and beside a top_p-only row, a top_k beyond 4,096 or
    a plain row ("sort" mode, raced by rows): the same draws under deterministic inference (an
    audit: a top_k of 1,025-4,096 with top_p drew otherwise beside such neighbours)."""
    vocab = 5000
    torch.manual_seed(4)
    row = (torch.randn(1, vocab) * 3).bfloat16().float()
    own = SampleParams(seed=11, temperature=4.0, top_k=top_k, top_p=0.6)
    outs = []
    for other in (None, SampleParams(seed=12, top_p=0.7), SampleParams(seed=13, temperature=0.5),
                  SampleParams(seed=14, top_k=4500)):
        s = Sampler(vocab, 4, "cpu", deterministic=True)
        s.add(0, own)
        slots = [0] if other is None else [0, 1]
        if other is not None:
            s.add(1, other)
        logits = row.expand(len(slots), -1).contiguous()
        outs.append([int(s.sample(logits, slots, _pos([p] * len(slots), torch.device("cpu"))).token_ids[0])
                     for p in range(16)])
    assert outs[0] == outs[1] == outs[2] and len(set(outs[0])) > 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("vocab", [5000, 128256])  # flashinfer's single- and multi-block kernels
def test_cuda_sort_free_masks_keep_the_sorts_survivors(vocab: int) -> None:
    """The GPU's "sort" mode without deterministic inference masks top_k / top_p with flashinfer's
    sort-free kernels: per row the same survivors as the sorted cumulative mass with min_p (one
    token apart at most, at the nucleus' edge, where rounding decides), and every draw of the
    served path (`Sampler.sample`) among them."""
    from engine.run import sampler as sampler_mod

    dev = torch.device("cuda")
    params = [SampleParams(seed=1, temperature=1.0, top_p=0.9), SampleParams(seed=2, temperature=0.7, top_p=0.5),
              SampleParams(seed=3, temperature=1.0, top_k=4500, top_p=0.8),  # past the candidates: sort mode
              SampleParams(seed=4, temperature=1.2, top_k=4200), SampleParams(seed=5, temperature=1.0),
              SampleParams(seed=6, temperature=2.0, top_p=0.3, min_p=0.05)]
    s = Sampler(vocab, 8, dev)
    assert s._masks
    for slot, p in enumerate(params):
        s.add(slot, p)
    slots = list(range(len(params)))
    torch.manual_seed(0)
    logits = torch.randn(len(params), vocab, device=dev) * 3
    batch = s._batch(slots)
    assert batch.plan.mode == "sort"
    cand, ids, _ = s._survivors(logits, batch, "sort", 0)
    cand = sampler_mod._min_p_mask(cand, batch.fp[sampler_mod._F_LOG_MIN_P], is_sorted=True)
    masked: list[set[int]] = []
    real_draw = s._draw
    s._draw = lambda z, i, b, p: (masked.extend(set((r > -math.inf).nonzero().squeeze(1).tolist()) for r in
                                                 sampler_mod._min_p_mask(z, b.fp[sampler_mod._F_LOG_MIN_P], False)),
                                  real_draw(z, i, b, p))[1]
    draws = [s.sample(logits, slots, torch.full((len(params),), pos, device=dev)).token_ids.tolist()
             for pos in range(20)]
    n = len(params)
    assert len(masked) == 20 * n
    assert all(m == masked[i % n] for i, m in enumerate(masked))  # the same nucleus every step
    for r in range(len(params)):
        by_sort, by_mask = set(ids[r][cand[r] > -math.inf].tolist()), masked[r]
        assert len(by_sort ^ by_mask) <= 1, (r, len(by_sort), len(by_mask))
        if r == 3:  # top_k alone: exactly its k (random floats do not tie)
            assert len(by_mask) == 4200
        elif r == 4:  # nothing to filter
            assert len(by_mask) == vocab
        else:
            assert 0 < len(by_mask) < vocab
        assert {d[r] for d in draws} <= by_mask


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_rank_keys_kernel_is_the_torch_keys() -> None:
    """ranked_topk's keys on CUDA come from one triton launch: the torch ops' keys bit for bit
    (ties, signed zeros, NaNs, infinities), so the GPU's deterministic candidates keep their order."""
    from engine.layers import triton_ops
    from engine.run.ranking import rank_keys

    dev = torch.device("cuda")
    torch.manual_seed(5)
    x = (torch.randn(9, 151936, device=dev) * 4).bfloat16().float()
    x[0, :6] = torch.tensor([0.0, -0.0, float("nan"), -float("nan"), float("inf"), -float("inf")], device=dev)
    assert torch.equal(triton_ops.rank_keys(x), rank_keys(x))
