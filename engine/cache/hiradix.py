"""The radix tree over two tiers: device pages (L1) and a host slab (L2); docs/architecture.md, Tiers.

A node's KV lives on the device (`pages`), in the host tier (`host`, an object in the
HostAllocator whose id is the node's id), or both. Invariants:

* device-resident nodes form an upper subtree: a host-only node's descendants are
  host-only (eviction goes bottom-up, load-back restores a whole path);
* a node being backed up (`host >= 0 and not committed`, "pending") keeps its device
  pages: only committed nodes may give them up, and then stay in the tree host-only;
* host-only nodes are never locked (a lock pins device pages; a match loads them back
  before it locks them).
* a *loading* node (the disk tier, L3) is a host-only leaf whose object is being read from
  L3 files by the cache controller (`start_l3_load`, op L3Load): host >= 0, not committed,
  no device pages. A match never goes into it; the tree locks its parent until the
  controller's L3Loaded, which commits it (a host-only node like any other) or drops it.
  A split piece of a loading object commits or drops with it (as a pending backup's do).

Every change is recorded, in order, as the op that replicates it (`changes`): CachePages /
EvictPages for device pages as before, plus HostInit, BackupPrepare, HostSplit,
ApplyCommit, LoadBack, HostEvict, L3Load. Eviction orders (device and host) are the same total
order as the base tree: (protected, last_access, node id).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator, Sequence

from engine.cache import l3
from engine.cache.allocator import PageAllocator
from engine.cache.radix import PROTECT_HITS, MatchResult, RadixCache, RadixNode
from engine.replica.host_alloc import HostAllocator
from msgs.codec import pack_ids
from msgs.steps import (
    ApplyCommit,
    BackupPrepare,
    CachePages,
    EvictPages,
    HostEvict,
    HostInit,
    HostSplit,
    L3Load,
    L3Touch,
    LoadBack,
)

L3_TOUCH_STEPS = 4096  # an object's L3 files are marked used again (L3Touch) at most once in this many steps


class TieredRadixCache(RadixCache):
    def __init__(
        self,
        page_size: int,
        allocator: PageAllocator,
        host_pages: int,
        policy: str = "write_through",
        warn: Callable[[str], None] | None = None,
        page_bytes: int = 0,
        num_layers: int = 0,
        l3_fingerprint: bytes = b"",
        kv_components: int = 2,
    ) -> None:
        if policy not in ("write_through", "write_through_selective"):
            raise ValueError(f"host tier write policy {policy!r} is not implemented")
        super().__init__(page_size, allocator)
        self.host = HostAllocator(host_pages)
        self.policy = policy
        self.warn = warn or (lambda _msg: None)
        self.objects: dict[int, RadixNode] = {}  # host object id -> its node
        self.pieces: dict[int, list[int]] = {}  # pending object -> objects split off it since
        self.origin: dict[int, int] = {}  # a split-off pending piece -> the object that commits it
        # (hit tokens by tier are counted per admitted request, by engine/sched/tiers.py: a load-back
        # here may serve a request that then waits and loads again)
        self.stats = {"backups": 0, "skipped": 0, "committed": 0, "load_backs": 0,
                      "host_evicted": 0, "l3_loads": 0, "l3_loaded": 0, "l3_failed": 0}
        # the disk tier (L3): on when the model has a fingerprint (--l3-dir)
        self.fingerprint = l3_fingerprint
        self.loading: dict[int, RadixNode] = {}  # loading object -> the parent the tree keeps locked
        self.from_l3: set[int] = set()  # committed nodes read from L3, not yet loaded back by a match
        self._l3_end: dict[int, bytes] = {}  # node id -> the L3 key of its last page (a cache)
        self.last_load = (0, 0)  # tokens the last load_back took from (L2, L3)
        self._l3_touched: dict[int, int] = {}  # host object -> the clock of its last L3Touch
        self.changes.append(HostInit(host_pages, page_bytes, num_layers, l3_fingerprint, kv_components))

    # ---- matching and inserting -----------------------------------------------------

    def match_prefix(self, tokens: Sequence[int], touch: bool = True) -> MatchResult:
        """As the base tree, but the match may continue into host-only nodes: those are
        `host_nodes` (not in `pages` / `num_tokens` until `load_back`)."""
        path, _ = self._walk(self._aligned(tokens))
        for i, n in enumerate(path):  # never into a node still being read from L3
            if not n.pages and self.is_loading(n):
                path = path[:i]
                break
        device = [n for n in path if n.pages]
        pages = [p for n in device for p in n.pages]
        if touch:
            for n in path:
                n.last_access = self.clock
                n.hits += 1
        node = device[-1] if device else self.root
        return MatchResult(pages, node, len(pages) * self.page_size, tuple(path[len(device):]))

    def load_back(self, match: MatchResult) -> MatchResult | None:
        """Give the match's host-only nodes device pages and emit LoadBack for each; the
        match grows by them. None (nothing changed) when the device pages cannot be found.
        The caller holds a lock on `match.node`, so eviction cannot take the path."""
        ps, nodes = self.page_size, match.host_nodes
        need = sum(len(n.key) for n in nodes) // ps
        first = len(match.pages)  # the request page index of the first loaded page (its owner under cp)
        while (pages := self.allocator.alloc(need, first)) is None:
            if not self.evict(self.allocator.shortfall(need, first)):
                return None
        at = l3_tokens = 0
        for node in nodes:
            k = len(node.key) // ps
            if node.id in self.from_l3:  # read from disk for this match: an L3 hit, once
                self.from_l3.discard(node.id)
                l3_tokens += k * ps
            node.pages = pages[at : at + k]
            at += k
            self._total_pages += k
            start = self.host.ranges[node.host][0]
            self.changes += [CachePages(pack_ids(node.pages)), LoadBack(node.host, pack_ids(node.pages), start)]
        self.stats["load_backs"] += len(nodes)
        self.last_load = (need * ps - l3_tokens, l3_tokens)
        return MatchResult(match.pages + pages, nodes[-1], match.num_tokens + need * ps)

    def insert_node(self, tokens: Sequence[int], pages: Sequence[int]) -> tuple[int, RadixNode]:
        """As the base tree, but host-only nodes on the path adopt the caller's pages (they
        are device-resident again), so the count returned covers device nodes only: the
        caller keeps `pages[: ret // page_size]`, the tree owns the rest. With write_through
        a new leaf is backed up at once."""
        ps = self.page_size
        if len(tokens) != len(pages) * ps:
            raise ValueError(f"insert: {len(tokens)} tokens do not fill {len(pages)} pages of {ps}")
        bad = [p for p in pages if not self.allocator.is_used(p)]
        if bad:
            raise ValueError(f"insert: pages {bad} are not allocated")
        path, _ = self._walk(tuple(map(int, tokens)))
        kept = at = 0
        for node in path:  # device nodes first, then host-only ones (the invariant)
            if node.pages:
                kept = at + len(node.key)
            else:
                if node.lock_ref:  # a lock pins device pages: a locked host-only node is a bug
                    raise RuntimeError(f"host-only node {node.id} is locked")
                node.pages = list(map(int, pages[at // ps : (at + len(node.key)) // ps]))
                self.from_l3.discard(node.id)  # computed again: no longer an L3 hit to count
                self._total_pages += len(node.pages)
                self.changes.append(CachePages(pack_ids(node.pages)))
            at += len(node.key)
        n, node = super().insert_node(tokens, pages)
        if n < len(tokens) and self.policy == "write_through":
            self.backup(node)
        return kept, node

    def touch(self, node: RadixNode) -> None:
        """A used match; with write_through_selective a node is backed up on its second hit. With
        the disk tier, the deepest committed host copy on the path is marked used in L3 too
        (L3Touch, at most every L3_TOUCH_STEPS steps an object): a hit in L1 / L2 reads no L3
        file, and the size cap would otherwise take a hot prefix's files first."""
        super().touch(node)
        if self.policy == "write_through_selective":
            for n in reversed(list(self._path_up(node))):  # top-down: parents are placed first
                if n.host < 0 and n.hits >= PROTECT_HITS and n.pages:
                    self.backup(n)
        if self.fingerprint:
            held = next((n for n in self._path_up(node) if n.host >= 0 and n.committed), None)
            if held is not None and self.clock - self._l3_touched.get(held.host, -L3_TOUCH_STEPS) >= L3_TOUCH_STEPS:
                self._l3_touched[held.host] = self.clock
                self.changes.append(L3Touch(held.host))

    # ---- backup and commit -------------------------------------------------------------

    def backup(self, node: RadixNode) -> bool:
        """Reserve host pages for node (evicting colder host objects to fit) and emit
        BackupPrepare; the workers copy after this step's forward. False: skipped."""
        start = self._reserve(node.id, len(node.pages), node.parent)
        if start is None:
            self.stats["skipped"] += 1
            self.warn(f"host tier full: backup of {len(node.pages)} pages skipped")
            return False
        node.host, node.committed = node.id, False
        self.objects[node.id] = node
        self.stats["backups"] += 1
        keys = l3.pack_keys(self.node_keys(node)) if self.fingerprint else b""
        self.changes.append(BackupPrepare(node.id, pack_ids(node.pages), start, keys, self._host_of(node.parent)))
        return True

    def _host_of(self, node: RadixNode | None) -> int:
        """node's host object (-1: none, or the root): an L3 chain's pages before a new object's."""
        return node.host if node is not None and node is not self.root else -1

    def _reserve(self, obj: int, n: int, above: RadixNode | None) -> int | None:
        """First fit; on a miss evict the coldest unpinned committed host copy (`_host_victim`),
        never one on the path to `above` (the new object's parent: its copy would be useless
        without theirs), and retry. A reservation that even every such copy gone could not hold
        fails before it evicts any (one that fails on fragmentation alone may have evicted some)."""
        if n > self.host.capacity:
            return None
        if self.host.find(n) is None:
            freeable = sum(self.host.ranges[o][1] for o, d in self.objects.items() if d.committed and not d.lock_ref)
            if n > self.host.capacity - self.host.num_used + freeable:
                return None
        keep: set[int] | None = None  # the path to `above`, made at the first miss
        while (start := self.host.reserve(obj, n)) is None:
            if keep is None:
                keep = {id(a) for a in self._path_up(above)} if above is not None else set()
            victim = self._host_victim(keep)
            if victim is None:
                return None
            self._drop_host(victim)
        return start

    def _host_victim(self, keep: set[int]) -> RadixNode | None:
        """The coldest committed, unlocked host copy with no host copy below it (host copies stay
        an upper subtree). Device-only children do not pin it: a prompt whose decode tail was not
        backed up would otherwise hold its L2 pages for as long as it stays on the device."""
        cands = [n for n in self.objects.values() if n.committed and n.lock_ref == 0 and id(n) not in keep
                 and all(c.host < 0 for c in n.children.values())]
        return min(cands, key=self._evict_key) if cands else None

    def _drop_host(self, node: RadixNode) -> None:
        """node's host copy goes; a host-only node leaves the tree with it."""
        self.host.release(node.host)
        self._l3_touched.pop(node.host, None)
        self.changes.append(HostEvict(node.host))
        del self.objects[node.host]
        node.host, node.committed = -1, False
        self.from_l3.discard(node.id)
        self.stats["host_evicted"] += 1
        if not node.pages:
            self._unlink(node)

    def commit(self, obj: int) -> None:
        """The controller's Committed(obj): obj and every piece split off it since are
        committed (ApplyCommit each). Unknown or already committed: a protocol bug."""
        for piece in [obj, *self.pieces.pop(obj, [])]:
            node = self.objects.get(piece)
            if node is None or node.committed:
                raise RuntimeError(f"Committed for host object {piece}, which is not pending")
            node.committed = True
            self.origin.pop(piece, None)
            self.host.commit(piece)
            self.changes.append(ApplyCommit(piece))
            self.stats["committed"] += 1

    @property
    def pending(self) -> int:
        """Objects not committed: backups in flight and L3 loads in flight."""
        return sum(1 for n in self.objects.values() if not n.committed)

    # ---- the disk tier (L3) ------------------------------------------------------------

    def is_loading(self, node: RadixNode) -> bool:
        return node.host >= 0 and not node.committed and self.origin.get(node.id, node.id) in self.loading

    def loading_at(self, node: RadixNode, tokens: Sequence[int]) -> bool:
        """Whether the match that ended at `node` stopped at a loading node (`tokens`: the
        tokens after it): its request waits for the load rather than computing them."""
        child = node.children.get(tuple(map(int, tokens[: self.page_size])))
        return child is not None and not child.pages and self.is_loading(child)

    def chain_end(self, node: RadixNode) -> bytes:
        """The L3 key of node's last page (the fingerprint for the root)."""
        stack = []
        while node is not self.root and node.id not in self._l3_end:
            stack.append(node)
            node = node.parent  # type: ignore[assignment]
        key = self.fingerprint if node is self.root else self._l3_end[node.id]
        for n in reversed(stack):
            key = l3.chain(key, n.key, self.page_size)[-1]
            self._l3_end[n.id] = key
        return key

    def node_keys(self, node: RadixNode) -> list[bytes]:
        assert node.parent is not None
        keys = l3.chain(self.chain_end(node.parent), node.key, self.page_size)
        self._l3_end[node.id] = keys[-1]
        return keys

    def start_l3_load(self, parent: RadixNode, tokens: Sequence[int], keys: Sequence[bytes]) -> bool:
        """A host-only loading node for `tokens` (len(keys) full pages, whose files exist)
        under `parent` (where a match ended; the caller holds it locked): reserve host pages
        (evict-to-fit) and emit L3Load. False, nothing changed, when L2 has no room."""
        ps, n = self.page_size, len(keys)
        toks = tuple(map(int, tokens[: n * ps]))
        if n < 1 or len(toks) != n * ps or toks[:ps] in parent.children:
            raise ValueError(f"L3 load of {n} pages under node {parent.id}: bad tokens or occupied")
        obj = self._next_id  # the node made below takes this id (reserving creates no node)
        start = self._reserve(obj, n, parent)
        if start is None:
            return False
        node = self._new_node(toks, [], parent)
        assert node.id == obj
        parent.children[toks[:ps]] = node
        self._leaves.pop(parent.id, None)
        self._leaves[node.id] = node
        node.host, node.committed = obj, False
        self.objects[obj] = node
        self.loading[obj] = parent
        self.lock(parent)  # the path above stays while the controller reads (whatever the request does)
        self._l3_end[obj] = keys[-1]
        self.changes.append(L3Load(obj, start, l3.pack_keys(keys), self._host_of(parent)))
        self.stats["l3_loads"] += 1
        return True

    def l3_loaded(self, obj: int, ok: bool) -> None:
        """The controller's L3Loaded(obj): commit the object and its pieces (ApplyCommit) or
        drop them (HostEvict); the parent is unlocked either way."""
        parent = self.loading.get(obj)
        if parent is None:
            raise RuntimeError(f"L3Loaded for host object {obj}, which is not loading")
        pieces = [obj, *self.pieces.get(obj, [])]
        if ok:
            self.commit(obj)
            self.from_l3.update(pieces)
            self.stats["l3_loaded"] += 1
        else:
            self.pieces.pop(obj, None)
            for node in sorted((self.objects[p] for p in pieces), key=lambda d: (-self._depth(d), d.id)):
                self.origin.pop(node.id, None)
                self._drop_host(node)
            self.stats["l3_failed"] += 1
        del self.loading[obj]
        self.unlock(parent)

    def _split(self, node: RadixNode, m: int) -> RadixNode:
        """The base split; node's host object splits with it (the prefix takes the prefix
        node's id), and a pending piece commits with the object it came from."""
        prefix = super()._split(node, m)
        if node.id in self.from_l3:
            self.from_l3.add(prefix.id)
        if node.host >= 0:
            cut = m // self.page_size
            self.host.split(node.host, cut, prefix.id)
            prefix.host, prefix.committed = prefix.id, node.committed
            self.objects[prefix.id] = prefix
            self.changes.append(HostSplit(node.host, cut, prefix.id))
            if not node.committed:
                root = self.origin.get(node.id, node.id)
                self.origin[prefix.id] = root
                self.pieces.setdefault(root, []).append(prefix.id)
        return prefix

    # ---- device eviction ---------------------------------------------------------------

    def _device_leaf(self, node: RadixNode) -> bool:
        """May give up its device pages now: unlocked, not pending, no device child."""
        return (
            bool(node.pages) and node.lock_ref == 0 and not (node.host >= 0 and not node.committed)
            and not any(c.pages for c in node.children.values())
        )

    def _nodes(self) -> Iterator[RadixNode]:
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def evict(self, num_pages: int) -> int:
        """Free at least num_pages device pages, coldest device leaf first: a committed
        node keeps its host copy (host-only now), any other leaves the tree (with its
        host-only descendants). Returns the pages freed."""
        heap = [self._evict_key(n) for n in self._nodes() if self._device_leaf(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            node = heapq.heappop(heap)[-1]
            parent = node.parent
            freed += self._drop_device(node) if node.committed else self._remove_subtree(node)
            if parent is not self.root and parent is not None and self._device_leaf(parent):
                heapq.heappush(heap, self._evict_key(parent))
        return freed

    def _drop_device(self, node: RadixNode) -> int:
        n = len(node.pages)
        self.allocator.free(node.pages)
        self.changes.append(EvictPages(pack_ids(node.pages)))
        self._total_pages -= n
        node.pages = []
        return n

    def _remove_subtree(self, node: RadixNode) -> int:
        """node has no host copy: it leaves the tree, its host-only descendants first
        (deepest first, then by id: one order on every replica)."""
        below = sorted(self._below(node), key=lambda d: (-self._depth(d), d.id))
        for d in below:
            self._drop_host(d)
        return self._remove_leaf(node)

    def _below(self, node: RadixNode) -> Iterator[RadixNode]:
        stack = list(node.children.values())
        while stack:
            d = stack.pop()
            yield d
            stack.extend(d.children.values())

    @staticmethod
    def _depth(node: RadixNode) -> int:
        depth = 0
        while node.parent is not None:
            node, depth = node.parent, depth + 1
        return depth

    def _remove_leaf(self, node: RadixNode) -> int:
        self._l3_end.pop(node.id, None)
        return super()._remove_leaf(node)

    def _unlink(self, node: RadixNode) -> None:
        self._l3_end.pop(node.id, None)
        parent = node.parent
        assert parent is not None and not node.children and node.lock_ref == 0 and not node.pages
        del parent.children[node.key[: self.page_size]]
        del self._leaves[node.id]
        if parent is not self.root and not parent.children:
            self._leaves[parent.id] = parent
        node.parent = None

    @property
    def evictable_pages(self) -> int:
        """Device pages eviction can free: unlocked nodes with no pending node at or below."""
        total = 0

        def visit(node: RadixNode) -> bool:  # True: a pending node at or below
            nonlocal total
            blocked = node.host >= 0 and not node.committed
            for c in node.children.values():
                blocked = visit(c) or blocked
            if not blocked and node.lock_ref == 0:
                total += len(node.pages)
            return blocked

        for c in self.root.children.values():
            visit(c)
        return total

    # ---- flush and checks --------------------------------------------------------------

    @property
    def flushable(self) -> bool:
        return super().flushable and not self.pending  # no backup and no L3 load may be in flight

    def reset(self) -> None:
        """Every tier emptied (Flush resets the host tier of every replica too)."""
        if self.pending:
            raise RuntimeError("flush while host backups are in flight")
        super().reset()
        self.host.reset()
        self.objects.clear()
        self.pieces.clear()
        self.origin.clear()
        self.from_l3.clear()
        self._l3_end.clear()
        self._l3_touched.clear()

    def _shape_ok(self, node: RadixNode) -> bool:
        if not node.pages:  # host-only: committed (or a loading leaf), unlocked, only host-only below
            if node.host >= 0 and not node.committed:
                return self.is_loading(node) and node.lock_ref == 0 and all(
                    not c.pages and self.is_loading(c) for c in node.children.values())
            return node.host >= 0 and node.committed and node.lock_ref == 0 and not any(
                c.pages for c in node.children.values())
        return super()._shape_ok(node)

    def check_invariants(self) -> None:
        super().check_invariants()
        self.host.check()
        held = {n.host: n for n in self._nodes() if n.host >= 0}
        if held != self.objects or set(self.host.ranges) != set(held):
            raise AssertionError("host objects out of sync with the tree")
        for obj, node in held.items():
            if obj != node.id or self.host.ranges[obj][1] * self.page_size != len(node.key):
                raise AssertionError(f"host object {obj}: wrong node or size")
            if node.committed != (obj in self.host.committed):
                raise AssertionError(f"host object {obj}: commit state differs")
        for obj, parent in self.loading.items():
            node = self.objects.get(obj)
            if node is None or node.committed or (parent is not self.root and parent.lock_ref < 1):
                raise AssertionError(f"loading object {obj}: gone, committed or its parent unlocked")
