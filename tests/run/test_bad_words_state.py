"""engine/run/bad_words.py against plain Python: the rings keep each slot's last WINDOW output tokens
through records of any length with a slot's tokens repeated in order, a slot seeded with its earlier
output (a retraction) holds what recording them would, and `ban` masks exactly vLLM's tokens."""

from __future__ import annotations

import random

import pytest
import torch

from engine.run.bad_words import NONE, WINDOW, BadWords

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _uploader(device: str):  # noqa: ANN202
    return lambda values, dtype: torch.tensor(values, dtype=dtype).to(device)


def _vllm_banned(words: list[list[int]], output: list[int]) -> set[int]:
    return {w[-1] for w in words if len(w) - 1 <= len(output) and output[len(output) - len(w) + 1:] == w[:-1]}


def _window(output: list[int]) -> list[int]:
    return ([NONE] * WINDOW + output)[-WINDOW:]


@pytest.mark.parametrize("device", DEVICES)
def test_rings_hold_the_last_tokens_through_repeated_records(device: str) -> None:
    rng = random.Random(0)
    slots = 5
    bw = BadWords(slots, torch.device(device), _uploader(device))
    outputs: list[list[int]] = [[] for _ in range(slots)]
    for slot in range(slots):
        bw.set(slot, [[1, 2]], [])
    for _ in range(60):
        entries = [(rng.randrange(slots), rng.randrange(100)) for _ in range(rng.randrange(1, 3 * WINDOW))]
        for s, t in entries:  # a slot's tokens in the order given
            outputs[s].append(t)
        bw.record(torch.tensor([s for s, _ in entries], device=device), torch.tensor([t for _, t in entries],
                                                                                     device=device))
        got = bw.history(torch.arange(slots, device=device))
        assert got.tolist() == [_window(o) for o in outputs]
    seeded = BadWords(slots, torch.device(device), _uploader(device))
    for slot in range(slots):  # a retraction's re-add: the tokens generated before
        seeded.set(slot, [[1, 2]], outputs[slot])
    every = torch.arange(slots, device=device)
    assert torch.equal(seeded.history(every), bw.history(every))
    assert torch.equal(seeded.count, bw.count)


@pytest.mark.parametrize("device", DEVICES)
def test_ban_is_vllms_rule_with_and_without_drafts(device: str) -> None:
    rng = random.Random(1)
    vocab, slots = 12, 4
    bw = BadWords(slots, torch.device(device), _uploader(device))
    # prefixes over the 4 tokens the outputs and drafts use (so they match), last tokens over the vocabulary
    words = [[[rng.randrange(4) for _ in range(n - 1)] + [rng.randrange(vocab)] for n in
              (rng.randrange(1, 5) for _ in range(rng.randrange(4, 12)))] for _ in range(slots)]
    words[3] = []  # a slot without words: nothing masked
    outputs = [[rng.randrange(4) for _ in range(rng.randrange(0, 20))] for _ in range(slots)]
    for s in range(slots):
        bw.set(s, words[s], outputs[s])
    priors = [[rng.randrange(4) for _ in range(rng.randrange(0, WINDOW + 3))] for _ in range(8)]
    rows = [rng.randrange(slots) for _ in priors]
    idx = torch.tensor(rows, device=device)
    masks = []
    for history, drafts in ((bw.history(idx), [[] for _ in priors]), (bw.verify_history(idx, priors), priors)):
        masked = bw.ban(torch.zeros(len(rows), vocab, device=device), idx, history).cpu()
        masks.append(masked)
        for j, s in enumerate(rows):
            want = _vllm_banned(words[s], outputs[s] + list(drafts[j]))
            assert {int(t) for t in torch.nonzero(masked[j].isinf()).flatten()} == want
            assert (masked[j][masked[j].isinf()] < 0).all()
    assert not torch.equal(*masks)  # the drafts moved what is banned: the check above saw them
