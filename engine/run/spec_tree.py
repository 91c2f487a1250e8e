"""Draft trees on a rank (docs/architecture.md, Speculative decoding, Trees): a verify row
[first token, tree drafts] whose drafts name their parents (Drafts.parents). Each token sits at
its depth's position and attends the cached KV and its ancestors only (the torch backend's tree
mask); every node's token is drawn as a one-token step at that position would draw it; the
longest accepted root-to-leaf path wins (ties: the lowest node index), then its bonus; and its
K/V, written at the row's slots in node order, are copied into the path's consecutive slots.
Rows are indexed [first token, node 0, node 1, ...]: row r = node r - 1."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from engine.layers.forward import ForwardBatch
from engine.layers.kv_pool import KVPool
from engine.replica import ReplicaError
from engine.run.sampler import SampleResult
from msgs.codec import unpack_ids
from msgs.steps import Forward

if TYPE_CHECKING:
    from engine.run.spec import VerifyRows


def is_chain(parents: list[int]) -> bool:
    return all(p == i - 1 for i, p in enumerate(parents))


def chain_part(parents: list[int]) -> int:
    """How many of the first drafts form a chain from the row's first token."""
    n = 0
    while n < len(parents) and parents[n] == n - 1:
        n += 1
    return n


def leaf_shaped(parents: list[int]) -> bool:
    """A worker-drafted tree (on_worker): a chain, then leaves beside its nodes (each leaf's parent
    the first token or a chain node that has a chain child)."""
    s = chain_part(parents)
    return all(-1 <= p <= s - 2 for p in parents[s:])


def leaf_alts(parents: list[list[int]]) -> int:
    """Candidates a worker draft needs at a position: its chain's and its leaves' beside it."""
    return 1 + max((sum(p == q for p in par[chain_part(par):]) for par in parents for q in set(par)), default=0)


def fill_leaves(ids: list[int], rows: list[tuple[int, list[int], list[list[int]]]]) -> None:
    """Each leaf of a worker-drafted tree row (its index in ids of the first token, its parents,
    the draft's best tokens at each chain step): the best token at its parent's next step that no
    sibling has (its chain child's, earlier leaves'); the chain's own token when none is left."""
    for first, par, top in rows:
        s = chain_part(par)
        taken: dict[int, list[int]] = {q: [ids[first + q + 2]] for q in range(-1, s - 1)}
        for j in range(s, len(par)):
            q = par[j]
            free = [t for t in top[q + 1] if t not in taken[q]]
            ids[first + 1 + j] = free[0] if free else taken[q][0]
            taken[q].append(ids[first + 1 + j])


def tree_parents(fwd: Forward, num: list[int], chained: list[int] | None, trees: bool) -> list[list[int]] | None:
    """Each row's parents (None: the Step has no tree); a malformed tree, or one this rank cannot
    verify, is a ReplicaError."""
    assert fwd.drafts is not None
    if not fwd.drafts.parents:
        return None
    if not trees:
        raise ReplicaError("a Step verifies a draft tree (Drafts.parents), but this rank verifies chains only "
                           "(--speculative-eagle-topk 1)")
    flat = unpack_ids(fwd.drafts.parents)
    if len(flat) != sum(num):
        raise ReplicaError(f"bad Drafts.parents: {len(flat)} parents for {sum(num)} drafts")
    out: list[list[int]] = []
    off = 0
    for i, k in enumerate(num):
        par, off = flat[off : off + k], off + k
        if any(not -1 <= p < j for j, p in enumerate(par)):
            raise ReplicaError(f"row {i}: bad draft tree {par} (a parent is -1 or an earlier draft)")
        if chained and chained[i] and not is_chain(par):
            raise ReplicaError(f"row {i}: a chained row must be a chain, not the tree {par}")
        if fwd.drafts.on_worker and not leaf_shaped(par):
            raise ReplicaError(f"row {i}: a worker-drafted tree is a chain with leaves beside it, not {par}")
        out.append(par)
    return out


def depths(parents: list[int]) -> list[int]:
    """Per row (the first token, then each draft): its depth below the first token."""
    out = [0]
    for p in parents:
        out.append(out[p + 1] + 1)
    return out


def paths(drafts: list[int], parents: list[int]) -> list[list[int]]:
    """Per row: the drafts from the first token down to it (its speculative penalty history)."""
    out: list[list[int]] = [[]]
    for i, p in enumerate(parents):
        out.append(out[p + 1] + [drafts[i]] if i < len(drafts) else out[p + 1])
    return out


def ancestors(parents: list[int]) -> torch.Tensor:
    """bool [n, n] over rows: [r, s] when row s is row r or above it."""
    n = len(parents) + 1
    a = torch.zeros((n, n), dtype=torch.bool)
    a[0, 0] = True
    for i, p in enumerate(parents):
        a[i + 1] = a[p + 1]
        a[i + 1, i + 1] = True
    return a


def tree_batch(runner: Any, batch: ForwardBatch, v: VerifyRows, slots: list[int], starts: list[int],
               lens: list[int], sample: list[int], tables: list[list[int]], page_size: int,
               followers: tuple[Any, ...] = ()) -> list[list[int]]:
    """Set a tree row's positions (its depths) and hand the backend (and those of `followers`,
    a separate draft model's that runs over the same batch) its mask; each sampled row's KV
    slots from its first token's on (where the forward writes rows 0, 1, ...)."""
    masks: dict[int, torch.Tensor] = {}
    positions: list[int] = []
    kv_slots: list[list[int]] = []
    j = 0
    assert v.parents is not None
    for i, (st, n, s) in enumerate(zip(starts, lens, sample, strict=True)):
        row = list(range(st, st + n))
        if s:
            par, k = v.parents[j], v.row_drafts[i]
            j += 1
            p0, first = st + n - k - 1, n - k - 1  # the first token's position and index in the row
            kv_slots.append([tables[i][q // page_size] * page_size + q % page_size for q in range(p0, st + n)])
            if not is_chain(par):
                if runner.grammar.constrained([slots[i]]):
                    raise ReplicaError(f"row {i}: a constrained request's row must be a chain (its grammar "
                                       "masks one path)")
                row[first:] = [p0 + d for d in depths(par)]
                m = torch.ones((n, n), dtype=torch.bool).tril()
                m[first:, first:] = ancestors(par)
                masks[i] = m
        positions.extend(row)
    for backend in (runner.backend, *followers):
        if not backend.takes_tree_masks:
            raise ReplicaError(f"draft trees need a backend that takes tree masks, not {type(backend).__name__}")
        backend.set_tree_masks(masks)
    pos = torch.tensor(positions, dtype=torch.int64)
    batch.positions = pos if batch.positions.device.type == "cpu" else pos.to(batch.positions.device,
                                                                               non_blocking=True)
    return kv_slots


def _tables(v: VerifyRows, w: int) -> tuple[torch.Tensor, ...]:
    """Host tables of the rows' trees, padded to w rows: parent row, depth, token, real,
    ancestors (bool [b, w, w]) and each row's ancestor row at each depth (-1 past it)."""
    assert v.parents is not None
    b = len(v.parents)
    par = torch.zeros((b, w), dtype=torch.int64)
    dep = torch.zeros((b, w), dtype=torch.int64)
    tok = torch.full((b, w), -2, dtype=torch.int64)  # -2: never a token
    real = torch.zeros((b, w), dtype=torch.bool)
    anc = torch.zeros((b, w, w), dtype=torch.bool)
    at = torch.full((b, w, w), -1, dtype=torch.int64)
    for r, (d, p) in enumerate(zip(v.drafts, v.parents, strict=True)):
        n = len(p) + 1
        real[r, :n] = True
        anc[r, :n, :n] = a = ancestors(p)
        dep[r, :n] = torch.tensor(depths(p))
        par[r, 1:n] = torch.tensor(p, dtype=torch.int64) + 1
        tok[r, 1 : 1 + len(d)] = torch.tensor(d, dtype=torch.int64)
        for q in range(n):
            up = a[q].nonzero().flatten()  # increasing row = increasing depth on a path
            at[r, q, : len(up)] = up
    return par, dep, tok, real, anc, at


def accept_tree(res: SampleResult, v: VerifyRows, valid: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """On the device, no host read: which logit rows are answered (the first token's and the
    accepted path's), each request's accepted drafts (-1: a void row), its bonus, and its path
    (row at each depth, -1 past the leaf). A node is accepted iff its token equals its parent
    row's draw and its parent was accepted; the deepest accepted node wins, ties the lowest."""
    rows = v.logit_rows
    dev = res.token_ids.device
    b, w = len(rows), max(rows)
    req = torch.repeat_interleave(torch.arange(b), torch.tensor(rows)).to(dev)
    col = torch.cat([torch.arange(n) for n in rows]).to(dev)
    target = torch.full((b, w), -1, dtype=torch.int64, device=dev)
    target[req, col] = res.token_ids
    par, dep, tok, real, anc, at = (t if dev.type == "cpu" else t.to(dev, non_blocking=True) for t in _tables(v, w))
    ok = (tok == target.gather(1, par)) & real
    ok[:, 0] = True
    full = ~(anc & ~ok[:, None, :]).any(-1) & real  # the node and every node above it accepted
    idx = torch.arange(w, device=dev)
    best = torch.where(full, dep * (w + 1) + (w - idx), -1).argmax(dim=1)
    ar = torch.arange(b, device=dev)
    accepted, bonus, path = dep[ar, best], target[ar, best], at[ar, best]
    if valid is not None:
        accepted = torch.where(valid, accepted, -1)
    keep = anc[ar, best][req, col] & (accepted[req] >= 0)
    return keep, accepted, bonus, path


def compact(pools: list[KVPool], v: VerifyRows, path: torch.Tensor, accepted: torch.Tensor,
            by_slot: tuple[torch.Tensor, ...] = ()) -> None:
    """Copy each tree row's accepted path's K/V (written at the slots of rows path[1..a]) to the
    slots of positions p0 + 1 .. p0 + a, on the device for every layer at once, in each pool (the
    target's, a draft's) and each tensor indexed by slot (a head's hidden pool); the rest of the
    row is trimmed by the scheduler (TrimReq). Deterministic: a pure function of the Step and
    the draws, which every rank shares."""
    assert v.parents is not None and v.kv_slots is not None
    trees = [j for j, p in enumerate(v.parents) if not is_chain(p)]
    if not trees:
        return
    b, w = path.shape
    dev = path.device
    table = torch.zeros((b, w), dtype=torch.int64)
    dst, flat = [], []
    for j in trees:
        table[j, : len(v.kv_slots[j])] = torch.tensor(v.kv_slots[j], dtype=torch.int64)
        for d in range(1, len(v.parents[j]) + 1):
            dst.append(v.kv_slots[j][d])
            flat.append(j * w + d)
    table = table.to(dev)
    idx = torch.arange(w, device=dev)[None, :]
    sel = torch.where((idx <= accepted[:, None]) & (path >= 0), path, idx)  # past the path: itself
    src = table.gather(1, sel).reshape(-1)[torch.tensor(flat, dtype=torch.int64).to(dev)]
    dst_t = torch.tensor(dst, dtype=torch.int64).to(dev)
    for t in [t for kv in pools for t in kv.all.values()]:
        raw = t.view(torch.uint8) if t.element_size() == 1 else t  # (8-bit float KV: copied as bytes)
        raw.index_copy_(1, dst_t, raw.index_select(1, src))
    for t in by_slot:
        t.index_copy_(0, dst_t, t.index_select(0, src))
