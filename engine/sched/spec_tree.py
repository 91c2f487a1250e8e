"""NGRAM draft trees (docs/architecture.md, Speculative decoding, Trees): the chain the
scheduler would draft, plus alternatives where the radix tree's continuations or the request's
own n-gram matches part, up to topk children a node. A pure function of the request's tokens
and the radix tree (its recency), so the Step stream stays replayable."""

from __future__ import annotations

import heapq

from engine.cache.radix import RadixCache
from engine.sched.request import Req
from engine.sched.spec import ngram_branches


def branches(cache: RadixCache | None, req: Req, path: list[int], k: int) -> list[int]:
    """Up to k distinct candidates for the token after req's tokens + `path`, best first: the
    radix tree's (most recently used first), then the request's own n-gram matches."""
    ids = req.all_ids + path
    out: list[int] = []
    if cache is not None:
        node = req.node if req.node is not None else cache.root
        out = cache.branches(node, ids[cache.depth(node):], k)
    for t in ngram_branches(ids, k):
        if len(out) >= k:
            break
        if t not in out:
            out.append(t)
    return out


def build_tree(cache: RadixCache | None, req: Req, chain: list[int], topk: int, nodes: int,
               depth: int) -> tuple[list[int], list[int]]:
    """The drafts of a tree (parents before children) and each one's parent (-1: the row's first
    token). `chain` (the scheduler's chain, at most `depth` long) is node 0, 1, ...: the tree
    always holds it, so it accepts at least what the chain would. Then, up to `nodes` drafts
    in all, alternatives by rank: a node's k-th candidate costs its parent's cost + k (its
    first, the continuation, costs nothing more), cheapest first, then shallowest, then the
    order they were found; no node deeper than `depth` nor with more than topk children."""
    toks = list(chain[: min(nodes, depth)])
    parents = list(range(-1, len(toks) - 1))
    heap: list[tuple[int, int, int, int, int]] = []  # (cost, depth, order, parent, token)
    order = 0

    def path_of(i: int) -> list[int]:
        out: list[int] = []
        while i >= 0:
            out.append(toks[i])
            i = parents[i]
        return out[::-1]

    def push(parent: int, cost: int, first_rank: int) -> None:
        nonlocal order
        d = len(path_of(parent))
        if d >= depth:
            return
        have = [t for t, p in zip(toks, parents, strict=True) if p == parent]
        cands = [t for t in branches(cache, req, path_of(parent), topk + len(have)) if t not in have]
        for r, t in enumerate(cands[: topk - len(have)]):
            heapq.heappush(heap, (cost + r + first_rank, d + 1, order, parent, t))
            order += 1

    for i in range(-1, len(toks)):  # the chain's nodes: their alternatives cost 1 and more
        push(i, 0, 1)
    while heap and len(toks) < nodes:
        cost, _, _, parent, t = heapq.heappop(heap)
        if sum(p == parent for p in parents) >= topk:
            continue
        toks.append(t)
        parents.append(parent)
        push(len(toks) - 1, cost, 0)
    return toks, parents


def leaf_tree(chain: int, topk: int, nodes: int) -> list[int]:
    """The parents of a draft model's or head's tree (its drafts proposed on the workers): its
    chain of `chain` drafts, then up to topk - 1 leaves beside each chain node (the draft's next
    best tokens at that position), the shallowest first, `nodes` drafts at most."""
    parents = list(range(-1, chain - 1))[:nodes]
    for d in range(chain):
        for _ in range(topk - 1):
            if len(parents) < nodes:
                parents.append(d - 1)
    return parents


def is_chain(parents: list[int]) -> bool:
    return all(p == i - 1 for i, p in enumerate(parents))
