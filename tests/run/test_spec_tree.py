"""NGRAM draft trees without a model (docs/architecture.md, Speculative decoding, Trees): the
longest accepted root-to-leaf path at the sampler level (ties: the lowest node), a chain's
answer unchanged, the accepted path's K/V compacted into consecutive slots, malformed trees
refused on the worker, the radix tree's branches and the scheduler's tree (a pure function
holding the chain), and the flags' checks."""

from __future__ import annotations

import pytest
import torch

from engine.cache.allocator import PageAllocator
from engine.cache.radix import RadixCache
from engine.config import ServerConfig
from engine.layers.kv_pool import KVPool
from engine.replica import ReplicaError
from engine.run.sample_params import SampleParams
from engine.run.sampler import Sampler
from engine.run.spec import Speculator, VerifyRows, _answered
from engine.run.spec_tree import accept_tree, compact, depths, fill_leaves, paths
from engine.sched.request import Req
from engine.sched.spec import ngram_branches
from engine.sched.spec_tree import build_tree, leaf_tree
from msgs.codec import pack_ids
from msgs.params import SamplingParams
from msgs.steps import Drafts, Forward

V = 6


def _tree_verify(logits: torch.Tensor, starts: list[int], drafts: list[list[int]], parents: list[list[int]]
                 ) -> tuple[list[int], list[list[int]], list[int], list[list[int]]]:
    """Greedy draws at every node's depth position, then the tree's acceptance: accepted,
    answered tokens, bonus and path per request."""
    sampler = Sampler(V, 4, "cpu")
    for s in range(len(drafts)):
        sampler.add(s, SampleParams(seed=s + 1, temperature=0.0))
    row_slots = [s for s, p in enumerate(parents) for _ in range(len(p) + 1)]
    positions = [st + 1 + d for st, p in zip(starts, parents, strict=True) for d in depths(p)]
    prior = [h for d, p in zip(drafts, parents, strict=True) for h in paths(d, p)]
    res = sampler.sample_verify(logits, row_slots, positions, prior)
    v = VerifyRows([len(d) for d in drafts], drafts, [len(d) for d in drafts], parents=parents)
    keep, accepted, bonus, path = accept_tree(res, v, None)
    out = _answered(res, keep, accepted)
    toks, answered, off = out.answered().token_ids.tolist(), [], 0
    for a in accepted.tolist():
        answered.append(toks[off : off + a + 1])
        off += a + 1
    assert bonus.tolist() == [r[-1] for r in answered]
    return accepted.tolist(), answered, bonus.tolist(), path.tolist()


def test_tree_accepts_the_longest_accepted_path() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6 + 5 + 4, V)
    arg = logits.argmax(-1).tolist()
    # request 0: root -> n0, n1; n0 -> n2; n1 -> n3, n4 (rows: root 0, n_i at 1 + i).
    # n0 wrong, n2 what n0's row draws (but under a rejected node), n1 right, n3 wrong, n4 right.
    bad = [(t + 1) % V for t in arg]
    d0, p0 = [bad[0], arg[0], arg[1], bad[2], arg[2]], [-1, -1, 0, 1, 1]
    # request 1: the same token twice under the root, each with a right child: both depth 2,
    # the lower node index (n2 under n0) wins
    d1, p1 = [arg[6], arg[6], arg[7], arg[8]], [-1, -1, 0, 1]
    # request 2: a chain, 2 of 3 right: as the chain rule answers
    d2, p2 = [arg[11], arg[12], bad[13]], [-1, 0, 1]
    accepted, answered, bonus, path = _tree_verify(logits, [10, 20, 30], [d0, d1, d2], [p0, p1, p2])
    assert accepted == [2, 2, 2]
    assert answered[0] == [arg[0], arg[2], arg[5]]  # root's draw (= n1), n1's draw (= n4), n4's (bonus)
    assert answered[1] == [arg[6], arg[7], arg[9]]  # n0's path, not n1's
    assert answered[2] == [arg[11], arg[12], arg[13]]
    assert path[0][:3] == [0, 2, 5] and path[1][:3] == [0, 1, 3]
    sp = Speculator(None, 16, torch.device("cpu"))  # the chain rule agrees on the chain
    s = Sampler(V, 4, "cpu")
    s.add(0, SampleParams(seed=3, temperature=0.0))
    res = s.sample(logits[11:15], [0] * 4, [31, 32, 33, 34])
    out, b = sp.accept(res, VerifyRows([3], [d2], [3]))
    assert out.accepted.tolist() == [2] and b.tolist() == [bonus[2]]
    assert out.answered().token_ids.tolist() == answered[2]


def test_compaction_moves_the_accepted_path_into_consecutive_slots() -> None:
    ps = 4
    kv = KVPool(2, 8, ps, 1, 2, torch.float32, "cpu")
    for t in kv.all.values():
        t.copy_(torch.randn_like(t))
    before = {n: t.clone() for n, t in kv.all.items()}
    table = [3, 5]  # positions 0..7: page 3, then page 5
    p0 = 2  # the row's first token at position 2; 5 drafts at positions 3..7 (rows 1..5)
    slots = [table[q // ps] * ps + q % ps for q in range(p0, p0 + 6)]
    v = VerifyRows([5], [[1, 2, 3, 4, 5]], [5], parents=[[-1, -1, 0, 1, 1]], kv_slots=[slots])
    path = torch.tensor([[0, 2, 5, -1, -1, -1]])  # root, n1 (row 2), n4 (row 5)
    compact([kv], v, path, torch.tensor([2]))
    for n, t in kv.all.items():
        assert torch.equal(t[:, slots[1]], before[n][:, slots[2]])  # position p0 + 1 <- row 2
        assert torch.equal(t[:, slots[2]], before[n][:, slots[5]])  # position p0 + 2 <- row 5
        rest = [s for s in range(kv.num_slots) if s not in (slots[1], slots[2])]
        assert torch.equal(t[:, rest], before[n][:, rest])


def _fwd(drafts: list[int], parents: list[int], on_worker: bool = False, chained: bytes = b"") -> Forward:
    return Forward(slots=pack_ids([0]), input_ids=pack_ids([7, *drafts]), start_pos=pack_ids([4]),
                   extend_lens=pack_ids([1 + len(drafts)]), sample=pack_ids([1]),
                   drafts=Drafts(num_drafts=pack_ids([len(drafts)]), parents=pack_ids(parents), on_worker=on_worker,
                                 chained=chained))


@pytest.mark.parametrize(("fwd", "trees", "match"), [
    (_fwd([1, 2, 3], [-1, 1, 0]), True, "bad draft tree"),  # a parent that is not an earlier draft
    (_fwd([1, 2, 3], [-1, -2, 0]), True, "bad draft tree"),
    (_fwd([1, 2, 3], [-1, 0]), True, "parents for 3 drafts"),
    (_fwd([1, 2, 3], [-1, -1, 0]), False, "chains only"),
    (_fwd([-1, -1, -1], [-1, -1, 0], on_worker=True), True, "chain with leaves"),  # a leaf with a child
    (_fwd([1, 2, 3], [-1, -1, 0], chained=pack_ids([1])), True, "chained row must be a chain"),
])
def test_malformed_trees_are_refused_on_the_worker(fwd: Forward, trees: bool, match: str) -> None:
    sp = Speculator(None, 16, torch.device("cpu"), trees=trees)
    with pytest.raises(ReplicaError, match=match):
        sp.rows(fwd, [7, 1, 2, 3], [[1]])
    ok = sp.rows(_fwd([1, 2, 3], [-1, -1, 1]), [7, 1, 2, 3], [[1]]) if trees else None
    assert ok is None or ok.parents == [[-1, -1, 1]]


def test_radix_branches_rank_as_the_continuation() -> None:
    c = RadixCache(4, PageAllocator(64))
    base = list(range(100, 108))
    for tail in ([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 9, 9, 9, 9, 9, 9]):
        m = c.match_prefix(base + tail)
        new = c.allocator.alloc(4 - len(m.pages))
        assert new is not None
        c.insert(base + tail, m.pages + new)
        c.tick()
    node = c.match_prefix(base, touch=False).node
    assert c.branches(node, [1, 2], 3) == [9, 3]  # the later path first, as continuation() picks
    assert c.branches(node, [1, 2], 3)[0] == c.continuation(node, [1, 2], 1)[0]
    assert c.branches(node, [1], 3) == [2] and c.branches(c.root, base + [1, 2, 3], 3) == [4]
    assert c.branches(node, [7], 3) == [] and c.branches(node, [1, 2], 1) == [9]


def test_scheduler_tree_holds_the_chain_and_is_a_pure_function() -> None:
    assert ngram_branches([5, 1, 2, 5, 1, 3, 5, 1], 3) == [3, 2]  # "5 1" followed by 3 (latest), then 2
    c = RadixCache(4, PageAllocator(64))
    base = list(range(100, 108))
    for tail in ([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 9, 9, 9, 9, 9, 9]):
        m = c.match_prefix(base + tail)
        new = c.allocator.alloc(4 - len(m.pages))
        assert new is not None
        c.insert(base + tail, m.pages + new)
        c.tick()
    req = Req("r", base + [1, 2], SamplingParams(max_new_tokens=8), 0, 8, 0)
    req.node = c.match_prefix(base, touch=False).node
    chain = c.continuation(req.node, [1, 2], 3)
    assert chain == [9, 9, 9]
    toks, parents = build_tree(c, req, chain, 2, 6, 3)
    assert toks[:3] == chain and parents[:3] == [-1, 0, 1]  # the chain first
    assert (3, -1) in zip(toks, parents, strict=True)  # the older path's next token, under the root
    i = list(zip(toks, parents, strict=True)).index((3, -1))
    assert (4, i) in zip(toks, parents, strict=True)  # ... and its continuation under it
    assert len(toks) <= 6 and max(depths(parents)) <= 3
    assert all(sum(p == q for p in parents) <= 2 for q in range(-1, len(toks)))  # topk children at most
    assert build_tree(c, req, chain, 2, 6, 3) == (toks, parents)


@pytest.mark.parametrize(("kw", "flag"), [
    (dict(speculative_eagle_topk=4), "--speculative-num-draft-tokens in 5..64"),
    (dict(speculative_eagle_topk=2, speculative_num_draft_tokens=99), "--speculative-num-draft-tokens in"),
    (dict(speculative_eagle_topk=2, speculative_num_draft_tokens=8, enable_deterministic_inference=True),
     "--speculative-eagle-topk 2: draft trees run without --enable-deterministic-inference"),
])
def test_bad_tree_flags_fail_at_start(kw: dict, flag: str) -> None:
    with pytest.raises(ValueError, match=flag.replace("-", r"\-").replace(".", r"\.")):
        ServerConfig(speculative_algorithm="NGRAM", **kw)
    ServerConfig(speculative_algorithm="STANDALONE", speculative_draft_layers=4, speculative_eagle_topk=2,
                 speculative_num_draft_tokens=8)  # a draft model's chain with leaves
    cfg = ServerConfig(speculative_algorithm="NGRAM", speculative_eagle_topk=3, speculative_num_draft_tokens=8)
    assert (cfg.speculative_num_steps, cfg.speculative_num_draft_tokens) == (3, 8)


def test_worker_trees_are_a_chain_with_leaves_filled_by_rank() -> None:
    assert leaf_tree(3, 3, 7) == [-1, 0, 1, -1, -1, 0, 0]  # the chain, then 2 leaves beside each node, shallow first
    assert leaf_tree(2, 2, 8) == [-1, 0, -1, 0] and leaf_tree(3, 1, 8) == [-1, 0, 1]
    ids = [7, 1, 2, 3, -1, -1, -1, -1]  # the first token, the chain 1 2 3, four leaves
    par = [-1, 0, 1, -1, -1, 0, 1]
    top = [[1, 4, 5], [2, 6, 2], [9, 3, 8]]  # the draft's best tokens at each step (the chain's first but once)
    fill_leaves(ids, [(0, par, top)])
    assert ids == [7, 1, 2, 3, 4, 5, 6, 9]
    sp = Speculator(None, 16, torch.device("cpu"), trees=True)
    fwd = _fwd([-1] * 7, par, on_worker=True)
    with pytest.raises(ReplicaError, match="no draft model"):  # shape accepted; no draft here to fill it
        sp.rows(fwd, [7] + [-1] * 7, [[1, 2]])
