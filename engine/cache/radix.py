"""Radix prefix cache over KV pages, owned by the scheduler.

Every node holds a key (token ids, a non-empty multiple of ``page_size`` long) and
one page per ``page_size`` tokens; children are keyed by their first page of tokens.
All state is a pure function of the call sequence: node ids come from a counter,
recency comes from a logical clock advanced by `tick()`, and eviction order is the
total order ``(protected, last_access, node.id)``. No wall clock, no hash-order
iteration decides anything.

Page ownership: pages held by tree nodes belong to the tree and go back to the
allocator only through `evict` or `reset`. See `insert` for the hand-over rule.
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from engine.cache.allocator import PageAllocator
from msgs.codec import pack_ids
from msgs.steps import CachePages, EvictPages, Flush

PROTECT_HITS = 2  # a node matched this many times moves to the protected LRU segment


@dataclass(eq=False, slots=True)
class RadixNode:
    """One tree node. `lock_ref` counts locks taken at this node or below it."""

    id: int
    key: tuple[int, ...]
    pages: list[int]
    parent: RadixNode | None
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0
    hits: int = 0
    host: int = -1  # its host-tier (L2) object (= this node's id) or -1; see hiradix.py
    committed: bool = False  # every rank finished the host copy; only then may `pages` go


@dataclass(frozen=True, slots=True)
class MatchResult:
    """`pages` cover the first `num_tokens` tokens; `node` is the deepest matched node."""

    pages: list[int]
    node: RadixNode
    num_tokens: int
    host_nodes: tuple[RadixNode, ...] = ()  # matched nodes below `node` held only in the host tier


class RadixCache:
    """Page-granular radix tree with lock counts and segmented-LRU eviction."""

    def __init__(self, page_size: int, allocator: PageAllocator) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.allocator = allocator
        # every change of which pages the tree holds, in order, as the op that replicates it;
        # the scheduler publishes them in the next Step (no silent side effects)
        self.changes: list[CachePages | EvictPages | Flush] = []
        self._init_state()

    def take_changes(self) -> list[CachePages | EvictPages | Flush]:
        changes, self.changes = self.changes, []
        return changes

    def _init_state(self) -> None:
        self._next_id = 0
        self.clock = 0
        self.root = self._new_node((), [], None)
        self._leaves: dict[int, RadixNode] = {}  # non-root nodes without children, by id
        self._total_pages = 0
        self._locked_pages = 0

    def _new_node(self, key: tuple[int, ...], pages: list[int], parent: RadixNode | None) -> RadixNode:
        node = RadixNode(self._next_id, key, pages, parent, last_access=self.clock)
        self._next_id += 1
        return node

    # ---- counters -------------------------------------------------------------------

    @property
    def total_pages(self) -> int:
        return self._total_pages

    @property
    def locked_pages(self) -> int:
        return self._locked_pages

    @property
    def evictable_pages(self) -> int:
        """Pages in unlocked nodes; all of them can be evicted (an unlocked subtree is unlocked)."""
        return self._total_pages - self._locked_pages

    def tick(self) -> int:
        """Advance the logical clock (once per planned step) and return its new value."""
        self.clock += 1
        return self.clock

    # ---- lookup and insert ---------------------------------------------------------

    def _aligned(self, tokens: Sequence[int]) -> tuple[int, ...]:
        n = len(tokens) // self.page_size * self.page_size
        return tuple(map(int, tokens[:n]))

    def _common(self, node: RadixNode, toks: tuple[int, ...], i: int) -> int:
        """Tokens of `node.key` matching `toks[i:]`, in whole pages."""
        ps, key = self.page_size, node.key
        limit = min(len(key), len(toks) - i)
        m = 0
        while m < limit and key[m : m + ps] == toks[i + m : i + m + ps]:
            m += ps
        return m

    def _split(self, node: RadixNode, m: int) -> RadixNode:
        """Split `node` after `m` tokens; return the new prefix node (the suffix keeps its id,
        so a caller holding `node` still holds the deepest node of its path)."""
        parent = node.parent
        assert parent is not None and 0 < m < len(node.key)
        cut = m // self.page_size
        prefix = self._new_node(node.key[:m], node.pages[:cut], parent)
        prefix.lock_ref, prefix.last_access, prefix.hits = node.lock_ref, node.last_access, node.hits
        node.key, node.pages, node.parent = node.key[m:], node.pages[cut:], prefix
        prefix.children[node.key[: self.page_size]] = node
        parent.children[prefix.key[: self.page_size]] = prefix
        return prefix

    def _walk(self, toks: tuple[int, ...]) -> tuple[list[RadixNode], int]:
        """Follow `toks` from the root, splitting where a match ends inside a node.
        Returns the matched non-root path and the number of matched tokens."""
        ps, node, i, path = self.page_size, self.root, 0, []
        while i < len(toks):
            child = node.children.get(toks[i : i + ps])
            if child is None:
                break
            m = self._common(child, toks, i)
            node = child if m == len(child.key) else self._split(child, m)
            path.append(node)
            i += m
            if node is not child:
                break
        return path, i

    def match_prefix(self, tokens: Sequence[int], touch: bool = True) -> MatchResult:
        """Longest page-aligned cached prefix of `tokens`. With `touch`, marks every matched
        node as accessed now and counts a hit on it (else call `touch(node)` once the match is
        used). Lock `result.node` before the next call that may evict, or its pages can be
        freed under you."""
        path, n = self._walk(self._aligned(tokens))
        pages: list[int] = []
        for node in path:
            if touch:
                node.last_access = self.clock
                node.hits += 1
            pages.extend(node.pages)
        return MatchResult(pages, path[-1] if path else self.root, n)

    def continuation(self, node: RadixNode, rest: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that follow `rest` in the tree below `node` (which holds what precedes
        rest): the tokens another cached sequence with the same prefix went on with (speculative
        decoding's NGRAM drafts). Where paths part, the most recently used wins (ties: the older
        node), so the answer is a pure function of the tree. Reads only: no split, no touch."""
        out: list[int] = []
        i, ps = 0, self.page_size
        while len(out) < k:  # (slices of `rest` only as long as a node's key: O(len(rest)) a call)
            left = len(rest) - i
            if left >= ps:  # a whole page left to match: the children are keyed by it
                kid = node.children.get(tuple(rest[i : i + ps]))
                m = min(left, len(kid.key)) if kid is not None else 0
                kids = [kid] if kid is not None and kid.key[:m] == tuple(rest[i : i + m]) else []
            else:
                want = tuple(rest[i:])
                kids = [c for c in node.children.values() if c.key[:left] == want]
            if not kids:
                break
            node = max(kids, key=lambda c: (c.last_access, -c.id))
            m = min(left, len(node.key))
            i += m
            out.extend(node.key[m : m + k - len(out)])
        return out

    def branches(self, node: RadixNode, rest: Sequence[int], k: int) -> list[int]:
        """Up to k distinct tokens that follow `rest` below `node` in some cached sequence,
        ranked as `continuation` chooses (most recently used first; ties: the older node), so
        the first is the continuation's next token (speculative decoding's NGRAM draft trees).
        Reads only."""
        i, ps = 0, self.page_size
        while True:
            want = tuple(rest[i:])
            if len(want) >= ps:  # a whole page left to match: the children are keyed by it
                kid = node.children.get(want[:ps])
                kids = [kid] if kid is not None and kid.key[: len(want)] == want[: len(kid.key)] else []
            else:
                kids = [c for c in node.children.values() if c.key[: len(want)] == want]
            if len(kids) == 1 and len(kids[0].key) <= len(want):  # rest goes on past this node
                node = kids[0]
                i += len(node.key)
                continue
            out: list[int] = []
            for c in sorted(kids, key=lambda c: (-c.last_access, c.id)):
                if len(c.key) > len(want) and c.key[len(want)] not in out:
                    out.append(c.key[len(want)])
            return out[:k]

    @staticmethod
    def depth(node: RadixNode) -> int:
        """Tokens on the path from the root to node."""
        n = 0
        while node.parent is not None:
            n, node = n + len(node.key), node.parent
        return n

    def touch(self, node: RadixNode) -> None:
        """Count a hit, now, on `node` and every node above it (a match that was used)."""
        for n in self._path_up(node):
            n.last_access = self.clock
            n.hits += 1

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> int:
        """`insert_node` without the node."""
        return self.insert_node(tokens, pages)[0]

    def insert_node(self, tokens: Sequence[int], pages: Sequence[int]) -> tuple[int, RadixNode]:
        """Insert a page-aligned prefix (``len(tokens) == len(pages) * page_size``) and return
        how many leading tokens were ALREADY in the tree (a multiple of page_size), and the
        node that now ends at `tokens` (the root for an empty insert).

        Ownership: ``pages[: ret // page_size]`` are NOT taken by the tree; they stay the
        caller's (to free, or to drop if they are the very pages the tree holds). The
        rest, ``pages[ret // page_size :]``, become owned by the tree. Recency is updated
        along the path; hit counts are not (only `match_prefix` counts hits). Raises
        ValueError, changing nothing, on a length mismatch or a page that is not allocated.
        """
        ps = self.page_size
        if len(tokens) != len(pages) * ps:
            raise ValueError(f"insert: {len(tokens)} tokens do not fill {len(pages)} pages of {ps}")
        alloc = self.allocator
        bad = [p for p in pages if not alloc.is_used(p)]
        if bad:
            raise ValueError(f"insert: pages {bad} are not allocated")
        toks = tuple(map(int, tokens))
        path, n = self._walk(toks)
        for node in path:
            node.last_access = self.clock
        if n < len(toks):
            new_pages = list(map(int, pages[n // ps :]))
            parent = path[-1] if path else self.root
            leaf = self._new_node(toks[n:], new_pages, parent)
            parent.children[leaf.key[:ps]] = leaf
            self._leaves.pop(parent.id, None)
            self._leaves[leaf.id] = leaf
            self._total_pages += len(new_pages)
            if new_pages:
                self.changes.append(CachePages(pack_ids(new_pages)))
            return n, leaf
        return n, path[-1] if path else self.root

    # ---- locking --------------------------------------------------------------------

    def _path_up(self, node: RadixNode) -> Iterator[RadixNode]:
        if node is not self.root and node.parent is None:
            raise ValueError(f"node {node.id} is no longer in the tree")
        while node is not self.root:
            yield node
            node = node.parent  # type: ignore[assignment]

    def lock(self, node: RadixNode) -> None:
        """Pin `node` and its ancestors against eviction (reference counted; root: no-op)."""
        for n in self._path_up(node):
            if n.lock_ref == 0:
                self._locked_pages += len(n.pages)
            n.lock_ref += 1

    def unlock(self, node: RadixNode) -> None:
        """Undo one `lock(node)`. Raises ValueError if `node` is not locked."""
        if node is not self.root and node.lock_ref <= 0:
            raise ValueError(f"unlock of unlocked node {node.id}")
        for n in self._path_up(node):
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self._locked_pages -= len(n.pages)

    # ---- eviction ---------------------------------------------------------------------

    @staticmethod
    def _evict_key(node: RadixNode) -> tuple[bool, int, int, RadixNode]:
        # ids are unique, so comparison never reaches the node itself
        return (node.hits >= PROTECT_HITS, node.last_access, node.id, node)

    def evict(self, num_pages: int) -> int:
        """Free at least `num_pages` pages by removing unlocked leaves, coldest first
        (probationary before protected, then by (last_access, id)); a parent left without
        children becomes a candidate. Returns pages freed (less if nothing more is evictable)."""
        heap = [self._evict_key(n) for n in self._leaves.values() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            node = heapq.heappop(heap)[-1]
            parent = node.parent
            freed += self._remove_leaf(node)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, self._evict_key(parent))
        return freed

    def _remove_leaf(self, node: RadixNode) -> int:
        parent = node.parent
        assert parent is not None and not node.children and node.lock_ref == 0
        del parent.children[node.key[: self.page_size]]
        del self._leaves[node.id]
        if parent is not self.root and not parent.children:
            self._leaves[parent.id] = parent
        self.allocator.free(node.pages)
        self.changes.append(EvictPages(pack_ids(node.pages)))
        self._total_pages -= len(node.pages)
        node.parent = None
        return len(node.pages)

    @property
    def flushable(self) -> bool:
        """Whether `reset` may run now (nothing locked)."""
        return self.locked_pages == 0

    def reset(self) -> None:
        """Drop every node, returning all tree pages to the allocator; clock and node ids
        restart from 0. Raises RuntimeError if anything is locked."""
        if any(c.lock_ref for c in self.root.children.values()):
            raise RuntimeError("reset of a radix cache with locked nodes")
        self.allocator.free([p for _, node in self._dfs() for p in node.pages])
        self.changes.append(Flush())
        self._init_state()

    # ---- introspection ----------------------------------------------------------------

    def _dfs(self) -> Iterator[tuple[int, RadixNode]]:
        """Pre-order (depth, node) over non-root nodes, children in key order."""
        stack = [(1, c) for _, c in sorted(self.root.children.items(), reverse=True)]
        while stack:
            depth, node = stack.pop()
            yield depth, node
            stack.extend((depth + 1, c) for _, c in sorted(node.children.items(), reverse=True))

    def pages_in_tree(self) -> set[int]:
        """Every device page the tree holds (a set: no order needed, so no sorted walk)."""
        pages: set[int] = set()
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            pages.update(node.pages)
            stack.extend(node.children.values())
        return pages

    def digest(self) -> str:
        """SHA-256 hex over a canonical pre-order encoding of (depth, key, pages, lock_ref)."""
        h = hashlib.sha256(b"strata.radix.v1|%d\n" % self.page_size)
        for depth, node in self._dfs():
            h.update(f"{depth}|{node.key}|{node.pages}|{node.lock_ref}\n".encode())
        return h.hexdigest()

    def check_invariants(self) -> None:
        """Walk the tree; raise AssertionError on broken structure, counters, lock counts,
        duplicate pages, or a tree page that the allocator considers free."""
        ps, total, locked, seen, leaves = self.page_size, 0, 0, set(), set()
        for _, node in self._dfs():
            _check(node.parent is not None and node.key and self._shape_ok(node), f"node {node.id}: bad shape")
            _check(node.parent.children.get(node.key[:ps]) is node, f"node {node.id}: bad parent link")
            _check(node.lock_ref >= sum(c.lock_ref for c in node.children.values()) >= 0,
                   f"node {node.id}: lock_ref below its children's")
            for p in node.pages:
                _check(p not in seen, f"page {p} held twice in the tree")
                _check(self.allocator.is_used(p),
                       f"page {p} is in the tree but not allocated")
                seen.add(p)
            total += len(node.pages)
            locked += len(node.pages) if node.lock_ref > 0 else 0
            if not node.children:
                leaves.add(node.id)
        _check(total == self._total_pages, f"total_pages {self._total_pages} != walked {total}")
        _check(locked == self._locked_pages, f"locked_pages {self._locked_pages} != walked {locked}")
        _check(leaves == set(self._leaves), "leaf index out of sync")


    def _shape_ok(self, node: RadixNode) -> bool:
        return len(node.key) == len(node.pages) * self.page_size


def _check(cond: object, msg: str) -> None:
    """Like assert, but survives ``python -O``."""
    if not cond:
        raise AssertionError(msg)
