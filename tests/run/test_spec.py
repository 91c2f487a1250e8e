"""Speculative decoding's parts without a model (docs/architecture.md, Speculative decoding):
acceptance at the sampler level (greedy: the longest prefix equal to the argmax; sampled: the
output distribution is the target's, a chi-square test), the n-gram drafter, the TrimReq op
on every replica, the wire (a plain step's bytes unchanged) and the flags' checks."""

from __future__ import annotations

import math
import random

import msgspec
import pytest
import torch

from engine.config import ServerConfig
from engine.replica import ReplicaError, rank_replica
from engine.run.sample_params import SampleParams
from engine.run.sampler import Sampler
from engine.run.spec import Speculator, VerifyRows
from engine.sched.request import Req
from engine.sched.spec import NgramIndex, SpecPolicy, ngram_drafts
from msgs.codec import pack_ids
from msgs.done import FromWorker, SpecDone, StepDone
from msgs.params import SamplingParams
from msgs.steps import AddReq, Drafts, ExtendPages, Forward, Step, ToWorker, TrimReq, WorkerSampling

V = 6
LOGITS = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -1.0])


def _verify(sampler: Sampler, logits: torch.Tensor, slots: list[int], starts: list[int],
            drafts: list[list[int]]) -> tuple[list[int], list[list[int]]]:
    """Sample every logit row as the runner does (position = start + 1 + row) and accept."""
    rows = [len(d) + 1 for d in drafts]
    row_slots = [s for s, n in zip(slots, rows, strict=True) for _ in range(n)]
    positions = [p + 1 + i for p, n in zip(starts, rows, strict=True) for i in range(n)]
    res = sampler.sample(logits, row_slots, positions)
    v = VerifyRows([len(d) for d in drafts], drafts, [len(d) for d in drafts])
    out, bonus = Speculator(None, 16, torch.device("cpu")).accept(res, v)
    accepted = out.accepted.tolist()
    toks, answered, off = out.answered().token_ids.tolist(), [], 0
    for a in accepted:
        answered.append(toks[off : off + a + 1])
        off += a + 1
    assert bonus.tolist() == [r[-1] for r in answered]
    return accepted, answered


def test_greedy_accepts_the_longest_prefix_equal_to_the_argmax() -> None:
    sampler = Sampler(V, 4, "cpu")
    sampler.add(0, SampleParams(seed=1, temperature=0.0))
    sampler.add(1, SampleParams(seed=2, temperature=0.0))
    torch.manual_seed(0)
    logits = torch.randn(7, V)
    arg = logits.argmax(-1).tolist()
    # request 0: 3 drafts, the first two right, the third wrong; request 1: 2 drafts, the first wrong
    d0 = [arg[0], arg[1], (arg[2] + 1) % V]
    d1 = [(arg[4] + 1) % V, arg[5]]
    accepted, answered = _verify(sampler, logits, [0, 1], [10, 20], [d0, d1])
    assert accepted == [2, 0]
    assert answered == [[arg[0], arg[1], arg[2]], [arg[4]]]
    accepted, answered = _verify(sampler, logits[:4], [0], [10], [arg[:3]])  # all right: 3 + the bonus
    assert accepted == [3] and answered == [arg[:4]]


def _chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs, strict=True))


@pytest.mark.parametrize("draft", [3, 4])  # the likeliest token, and an unlikely one
def test_rejection_sampling_keeps_the_target_distribution(draft: int) -> None:
    """N requests (one seed each) verify one draft at temperature 0.7: the first answered token
    is distributed as the target's p (chi-square, 5 degrees of freedom, p > 0.001), the draft is
    accepted at rate p(draft), and a rejection's token follows p without the draft."""
    n, temp = 4000, 0.7
    p = torch.softmax(LOGITS / temp, -1).tolist()
    sampler = Sampler(V, n, "cpu")
    for s in range(n):
        sampler.add(s, SampleParams(seed=1000 + s, temperature=temp))
    logits = LOGITS.repeat(2 * n, 1)
    accepted, answered = _verify(sampler, logits, list(range(n)), [37] * n, [[draft]] * n)
    first = [a[0] for a in answered]
    counts = [first.count(t) for t in range(V)]
    assert _chi_square(counts, p) < 20.5, (counts, [round(n * q) for q in p])  # chi2(5) 0.999 quantile: 20.52
    rate = sum(accepted) / n
    assert abs(rate - p[draft]) < 4 * math.sqrt(p[draft] * (1 - p[draft]) / n)
    rejected = [a[0] for a, k in zip(answered, accepted, strict=True) if k == 0]
    assert draft not in rejected
    rest = [q / (1 - p[draft]) for t, q in enumerate(p) if t != draft]
    counts = [rejected.count(t) for t in range(V) if t != draft]
    assert _chi_square(counts, rest) < 18.5  # chi2(4) 0.999 quantile: 18.47


def test_ngram_drafts_follow_the_latest_match() -> None:
    ids = [5, 6, 7, 8, 1, 5, 6, 7, 9, 2, 5, 6, 7]
    assert ngram_drafts(ids, 2) == [9, 2]  # "5 6 7" last seen before 9, 2
    assert ngram_drafts(ids + [3], 3) == []  # 3 never seen before
    assert ngram_drafts([1, 2, 1], 4) == [2, 1]  # a 1-gram match; fewer tokens than asked
    assert ngram_drafts([4, 4, 4, 4], 2) == [4]
    assert ngram_drafts(ids, 0) == []


def test_the_ngram_index_drafts_as_the_scan_does() -> None:
    """NgramIndex (the scheduler's O(1) lookup, fed a growing token list) answers what
    ngram_drafts' scan answers, with and without a chained row's tail, window included."""
    rng = random.Random(0)
    for vocab, window in ((3, 4096), (6, 4096), (50, 4096), (4, 9)):
        index, ids = NgramIndex(window=window), []
        for _ in range(120):
            ids = ids + [rng.randrange(vocab) for _ in range(rng.choice((1, 1, 2, 4)))]
            k = rng.randrange(0, 5)
            assert index.drafts(ids, k) == ngram_drafts(ids, k, window=window), (ids, k)
            tail = [rng.randrange(vocab) for _ in range(rng.randrange(1, 4))]
            assert index.drafts(ids, k + 1, tail) == ngram_drafts(ids + tail, k + 1, window=window)
    assert NgramIndex().drafts([1, 2, 1, 2], 3) == [1, 2] and NgramIndex().drafts([7], 2) == []
    short = NgramIndex()
    assert short.drafts([5, 6, 5, 6, 5], 2) == [6, 5]
    assert short.drafts([5, 6], 2) == ngram_drafts([5, 6], 2)  # a shorter list: rebuilt


def test_a_corrupting_oracle_spoils_drafts_at_its_rate_and_the_same_way_each_time() -> None:
    """--speculative-corrupt-drafts (bin/bench spec's oracle with a per-token acceptance)."""
    prompt = list(range(10, 40)) * 2  # "... 38 39 | 10 11 ...": the n-gram lookup's continuation
    req = Req("r1", prompt, SamplingParams(), seed=7, max_new_tokens=64, arrival=0)
    clean = SpecPolicy("NGRAM", 5)
    spoiled = SpecPolicy("NGRAM", 5, corrupt=0.3, vocab_size=1000)
    want = clean.drafts(req, 5)
    assert want == ngram_drafts(prompt, 5) and len(want) == 5
    assert spoiled.drafts(req, 5) == spoiled.drafts(req, 5)  # a pure function of request and position
    wrong = total = 0
    for n in range(30, 60):  # the same lookups at 30 positions
        req.prompt_ids = prompt[:n]
        good, got = clean.drafts(req, 5), spoiled.drafts(req, 5)
        assert all(g == t or g == (t + 1) % 1000 for g, t in zip(got, good, strict=True))
        wrong += sum(g != t for g, t in zip(got, good, strict=True))
        total += len(good)
    assert total >= 100 and 0.15 < wrong / total < 0.45
    other = Req("r2", prompt, SamplingParams(), seed=7, max_new_tokens=64, arrival=1)
    assert [spoiled.drafts(Req(f"r{i}", prompt, SamplingParams(), seed=7, max_new_tokens=64, arrival=i), 5)
            for i in range(8)] != [spoiled.drafts(other, 5)] * 8  # another request, other spoils


def _sampling() -> WorkerSampling:
    return WorkerSampling(0.0, 1.0, -1, 0.0, 1.0, 0.0, 0.0, 1, False, 0)


def test_trim_req_applies_the_same_on_every_replica() -> None:
    replicas = [rank_replica(), rank_replica()]
    ops = [AddReq(3, "r", _sampling(), pack_ids([1, 2])), ExtendPages(3, pack_ids([4, 9, 7, 8])), TrimReq(3, 2)]
    for r in replicas:
        r.apply_step(Step(seq=1, ops=ops))
    assert replicas[0]["page_tables"].tables[3] == [4, 9]
    assert replicas[0].digest() == replicas[1].digest()
    other = rank_replica()
    other.apply_step(Step(seq=1, ops=ops[:2]))
    assert other.digest() != replicas[0].digest()  # the digest covers the trim
    with pytest.raises(ReplicaError, match="keeps 3"):
        replicas[0].apply(TrimReq(3, 3))  # never grows a table
    with pytest.raises(ReplicaError, match="unknown slot"):
        replicas[0].apply(TrimReq(5, 0))


def test_wire_plain_steps_unchanged_and_spec_messages_round_trip() -> None:
    class OldForward(msgspec.Struct, frozen=True):  # Forward as it was before speculation
        slots: bytes
        input_ids: bytes
        start_pos: bytes
        extend_lens: bytes
        sample: bytes

    args = [pack_ids([0]), pack_ids([5]), pack_ids([3]), pack_ids([1]), pack_ids([1])]
    assert msgspec.msgpack.encode(Forward(*args)) == msgspec.msgpack.encode(OldForward(*args))
    spec = Forward(*args[:1], pack_ids([5, 6, 7]), args[2], pack_ids([3]), args[4],
                   drafts=Drafts(num_drafts=pack_ids([2]), on_worker=True))
    step = Step(seq=4, ops=[TrimReq(0, 1)], forward=spec)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(step), type=ToWorker) == step
    done = SpecDone(seq=4, rank=0, token_ids=pack_ids([6, 9]), accepted=pack_ids([1]))
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(done), type=FromWorker)
    assert back == done and isinstance(back, StepDone)
    plain = StepDone(seq=4, rank=0, token_ids=pack_ids([6]))
    assert type(msgspec.msgpack.decode(msgspec.msgpack.encode(plain), type=FromWorker)) is StepDone


@pytest.mark.parametrize(("kw", "flag"), [
    (dict(speculative_num_steps=2), "--speculative-algorithm"),
    (dict(speculative_algorithm="EAGLE"), "--speculative-algorithm EAGLE needs --speculative-draft-model-path"),
    (dict(speculative_algorithm="MEDUSA"), "bad --speculative-algorithm"),
    (dict(speculative_algorithm="STANDALONE"), "--speculative-draft-layers"),
    (dict(speculative_algorithm="NGRAM", speculative_eagle_topk=4), "--speculative-eagle-topk"),
    (dict(speculative_algorithm="NGRAM", speculative_num_steps=2, speculative_num_draft_tokens=5),
     "--speculative-num-draft-tokens"),
    (dict(speculative_algorithm="NGRAM", speculative_draft_layers=4), "need --speculative-algorithm STANDALONE"),
    (dict(speculative_algorithm="STANDALONE", speculative_draft_model_path="/nonexistent"), "no such directory"),
    (dict(speculative_algorithm="STANDALONE", speculative_draft_model_path="/tmp", speculative_draft_layers=2),
     "choose one draft"),
    (dict(speculative_algorithm="NGRAM", speculative_num_steps=40), "--speculative-num-steps"),
    (dict(speculative_algorithm="STANDALONE", speculative_draft_layers=-1), "--speculative-draft-layers must be >= 0"),
    (dict(speculative_algorithm="NGRAM", speculative_corrupt_drafts=1.0), "--speculative-corrupt-drafts"),
    (dict(speculative_algorithm="STANDALONE", speculative_draft_layers=2, speculative_corrupt_drafts=0.3),
     "--speculative-corrupt-drafts"),
])
def test_bad_speculative_flags_fail_at_start(kw: dict, flag: str) -> None:
    with pytest.raises(ValueError, match=flag.replace("-", r"\-").replace("*", r"\*")):
        ServerConfig(**kw)


def test_speculative_defaults() -> None:
    cfg = ServerConfig(speculative_algorithm="NGRAM")
    assert (cfg.speculative_num_steps, cfg.speculative_num_draft_tokens) == (3, 4)
    assert ServerConfig.from_json(cfg.to_json()) == cfg
    # an audit: SGLang's NGRAM command lines give only --speculative-num-draft-tokens (a chain of N - 1 drafts)
    cfg = ServerConfig(speculative_algorithm="NGRAM", speculative_num_draft_tokens=8)
    assert (cfg.speculative_num_steps, cfg.speculative_num_draft_tokens) == (7, 8)
    # the message names the flag given (an audit: it named --speculative-num-steps, derived here)
    with pytest.raises(ValueError, match="--speculative-num-draft-tokens 40 makes a chain of 39 drafts: at most 16"):
        ServerConfig(speculative_algorithm="NGRAM", speculative_num_draft_tokens=40)
    with pytest.raises(ValueError, match="--speculative-num-steps must be in"):
        ServerConfig(speculative_algorithm="NGRAM", speculative_num_steps=40)
    for n in (1, -3):  # (was "--speculative-num-draft-tokens must be --speculative-num-steps + 1 = 4")
        with pytest.raises(ValueError, match="--speculative-num-draft-tokens must be >= 2"):
            ServerConfig(speculative_algorithm="NGRAM", speculative_num_draft_tokens=n)


def test_verify_rows_see_the_drafts_before_them_in_their_penalty_history() -> None:
    """Row j of a verify is penalized as a one-token step after drafts d[:j] were answered; and
    `record` adds only what was answered."""
    pen = SampleParams(seed=3, temperature=0.9, repetition_penalty=1.4, frequency_penalty=0.5, presence_penalty=0.3)
    torch.manual_seed(1)
    logits = torch.randn(3, V)
    drafts = [2, 5]
    spec = Sampler(V, 2, "cpu")
    spec.add(0, pen, prompt_ids=[1])
    got = spec.sample_verify(logits, [0, 0, 0], [8, 9, 10], [[], drafts[:1], drafts]).token_ids.tolist()
    for j in range(3):
        one = Sampler(V, 2, "cpu")
        one.add(0, pen, prompt_ids=[1], output_ids=drafts[:j])
        assert one.sample(logits[j : j + 1], [0], [8 + j]).token_ids.tolist() == [got[j]]
    spec.record(torch.tensor([0, 0]), torch.tensor([2, 2]))  # two answered tokens: counts 2
    one = Sampler(V, 2, "cpu")
    one.add(0, pen, prompt_ids=[1], output_ids=[2, 2])
    assert torch.equal(spec.apply_penalties(logits, [0, 0, 0]), one.apply_penalties(logits, [0, 0, 0]))
