"""What the scheduler's parts share: its config, the requests and where they stand, the
page allocator, the radix tree, and each request's KV pages (`RequestKV`)."""

from __future__ import annotations

import heapq
import random
from collections import deque
from dataclasses import dataclass, field

import structlog

from engine.cache.allocator import OwnedPageAllocator, PageAllocator, make_allocator
from engine.cache.hiradix import TieredRadixCache
from engine.cache.l3 import check_cap
from engine.cache.radix import RadixCache
from engine.cache.slab import available_memory
from engine.config import ServerConfig
from engine.replica.components import GrammarKeys
from engine.sched.request import Req
from engine.sched.spec import SpecPolicy, SpecStats
from engine.sched.tiers import Tiers, make_cache
from msgs.codec import pack_ids
from msgs.done import WorkerReady
from msgs.steps import ExtendPages, FreeReq, Op, TrimReq

EVICT_BATCH_DIVISOR = 1024  # an eviction frees at least this fraction of the pool (RequestKV.alloc)

log = structlog.get_logger()


@dataclass(frozen=True)
class SchedConfig:
    num_pages: int  # including the reserved padding page 0
    page_size: int
    max_running: int
    max_prefill_tokens: int  # token budget per step (decode tokens count one each)
    max_context: int
    eos_token_ids: tuple[int, ...]
    vocab_size: int  # prompt ids and stop ids are checked against it (defence in depth)
    enable_radix: bool = True
    seed: int = 0
    digest_every: int = 64
    num_ranks: int = 1  # workers replaying the stream; each reports every DigestCheck
    cp_size: int = 1  # context parallelism: page owners (a pool of num_pages per owner)
    host_pages: int = 0  # the host tier's (L2) pages; 0: no host tier
    write_policy: str = "write_through"  # when cached KV is copied to L2
    page_bytes: int = 0  # a worker's KV page across every layer: a host-tier page
    num_layers: int = 0  # layers of that page (the L3 files' layout)
    kv_components: int = 2  # KV layout components per layer of that page (K and V; MLA: 1)
    l3_dir: str = ""  # the disk tier's directory (--l3-dir); "": no disk tier
    l3_fingerprint: bytes = b""  # the workers' model fingerprint: the L3 key chain's start
    spec_algorithm: str = ""  # speculative decoding: "" (off) | NGRAM | STANDALONE (engine/sched/spec.py)
    spec_steps: int = 0  # drafts per row at most (a tree's depth)
    spec_topk: int = 1  # > 1: NGRAM draft trees, up to topk alternatives a position (engine/sched/spec_tree.py)
    spec_tree_nodes: int = 0  # a tree's drafts at most (--speculative-num-draft-tokens - 1)
    spec_corrupt: float = 0.0  # bin/bench spec's oracle: a looked-up draft made wrong with this chance
    # drafts per row by the step's decode rows: (rows, steps), above rows at most steps (engine/sched/spec.py)
    spec_by_batch: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if self.num_pages < 2 or self.max_context < 2 or self.max_prefill_tokens < 1 or self.vocab_size < 1:
            raise ValueError(f"bad scheduler config {self}")

    @classmethod
    def build(cls, cfg: ServerConfig, ready: WorkerReady, num_ranks: int, digest_every: int) -> SchedConfig:
        """The one place a SchedConfig is made: the server's flags plus what the workers
        agreed on (the smallest pool, the model's context, vocabulary and EOS ids)."""
        l3_dir = cfg.l3_dir if cfg.enable_hierarchical_cache else ""
        if l3_dir:
            check_cap(cfg.l3_size, ready.page_bytes * cfg.tp_size)  # a page file: every tp rank's part
        return cls(
            num_pages=ready.num_pages,
            page_size=ready.page_size,
            max_running=cfg.max_running_requests,
            max_prefill_tokens=cfg.max_prefill_tokens,
            max_context=ready.max_context,
            eos_token_ids=tuple(ready.eos_token_ids),
            vocab_size=ready.vocab_size,
            enable_radix=not cfg.disable_radix_cache,
            seed=cfg.seed,
            digest_every=digest_every,
            num_ranks=num_ranks,
            cp_size=cfg.cp_size,
            host_pages=host_pages(cfg, ready, cfg.tp_size),  # the slab: one region per tp rank (cp shares it)
            write_policy=cfg.hicache_write_policy,
            page_bytes=ready.page_bytes,
            num_layers=ready.num_layers,
            kv_components=ready.kv_components,
            l3_dir=l3_dir,
            l3_fingerprint=ready.l3_fingerprint,
            spec_algorithm=cfg.speculative_algorithm,
            spec_steps=cfg.speculative_num_steps,
            spec_topk=cfg.speculative_eagle_topk,
            spec_tree_nodes=cfg.speculative_num_draft_tokens - 1,
            spec_corrupt=cfg.speculative_corrupt_drafts,
            spec_by_batch=cfg.speculative_steps_by_batch,
        )


@dataclass
class SchedState:
    cfg: SchedConfig
    alloc: PageAllocator | OwnedPageAllocator = field(init=False)
    cache: RadixCache = field(init=False)
    tiers: Tiers | None = field(init=False)  # the host tier's part, when it is on
    reqs: dict[str, Req] = field(default_factory=dict)  # every unfinished request
    waiting: deque[Req] = field(default_factory=deque)
    running: list[Req] = field(default_factory=list)
    free_slots: list[int] = field(init=False)  # a heap: lowest free slot first
    pending_ops: list[Op] = field(default_factory=list)  # ops decided between plans (FreeReq)
    grammar_keys: GrammarKeys = field(default_factory=GrammarKeys)  # what every rank holds (engine/sched/grammars.py)
    rng: random.Random = field(init=False)  # seeds for requests that gave none
    spec: SpecPolicy | None = field(init=False)  # speculative decoding, when on
    spec_stats: SpecStats = field(default_factory=SpecStats)
    arrivals: int = 0
    cache_hit_tokens: int = 0
    retractions: int = 0

    def __post_init__(self) -> None:
        self.alloc = make_allocator(self.cfg.num_pages, self.cfg.cp_size)
        self.cache = make_cache(self.cfg, self.alloc)
        self.tiers = Tiers(self.cache, self.cfg.l3_dir) if isinstance(self.cache, TieredRadixCache) else None
        self.free_slots = list(range(self.cfg.max_running))
        self.rng = random.Random(self.cfg.seed)
        self.spec = SpecPolicy(self.cfg.spec_algorithm, self.cfg.spec_steps,
                               self.cache if self.cfg.enable_radix else None, self.cfg.spec_topk,
                               self.cfg.spec_tree_nodes, self.cfg.spec_corrupt,
                               self.cfg.vocab_size, self.cfg.spec_by_batch) if self.cfg.spec_algorithm else None


def host_pages(cfg: ServerConfig, ready: WorkerReady, ranks: int = 1, room: int | None = None) -> int:
    """L2 pages: --hicache-size GB of host pages, else --hicache-ratio x the device pool, within
    `room` bytes of host memory for the whole slab (every rank's region; default: 80% of what
    is available now, 60% with the disk tier on, whose writer queue may take another 20%).
    The ratio is capped to fit, with a warning (an H200's 1M-token pool at the default ratio 2
    would need 226 GiB, and pinning it failed at the first step); an explicit --hicache-size
    that cannot fit stops the start-up with a clear error."""
    if not cfg.enable_hierarchical_cache:
        return 0
    if cfg.hicache_size > 0:
        if ready.page_bytes <= 0:
            raise ValueError("--hicache-size needs the workers' page size in bytes")
        want = max(1, int(cfg.hicache_size * 2**30) // ready.page_bytes)
    else:
        # the device pool of every cp rank: the slab holds each of their pages once
        want = max(1, int(cfg.hicache_ratio * (ready.num_pages - 1) * cfg.cp_size))
    if ready.page_bytes <= 0:  # no layout given (unit tests): nothing to size against
        return want
    if room is None:  # 80% of what is free; 60% with L3 on (its writer queue takes up to 20%)
        room = available_memory() * (3 if cfg.l3_dir else 4) // 5
    fits = room // (ready.page_bytes * ranks)
    if want <= fits:
        return want
    need_gib = want * ready.page_bytes * ranks / 2**30
    if cfg.hicache_size > 0:
        raise ValueError(f"--hicache-size {cfg.hicache_size:g} needs {need_gib:.1f} GiB of host memory for "
                         f"{ranks} rank(s); {room / 2**30:.1f} GiB are available")
    if fits < 1:
        raise ValueError(f"no host memory for the host tier: {room / 2**30:.2f} GiB available")
    log.warning("host tier capped to the host memory available", wanted_gib=round(need_gib, 1),
                capped_gib=round(fits * ready.page_bytes * ranks / 2**30, 1), pages=fits)
    return fits


class RequestKV:
    """A request's KV pages and slot: growth, publication in the radix tree, release."""

    def __init__(self, state: SchedState) -> None:
        self.s = state
        # eviction builds a heap over the tree's leaves each call; at a full pool a decode batch
        # allocates a few pages a step, one call each (1.2 ms at 5k leaves, a review measured), so
        # a call frees at least 1/EVICT_BATCH_DIVISOR of the pool, not one page
        self.evict_batch = max(1, state.cfg.num_pages // EVICT_BATCH_DIVISOR)

    def pages_for(self, req: Req, new_tokens: int) -> int:
        total = -(-(req.kv_len + new_tokens) // self.s.cfg.page_size)
        return max(0, total - len(req.pages))

    def alloc(self, n: int, first: int = 0) -> list[int] | None:
        """Pages for a request's page indices first .. first + n - 1 (their owners under cp),
        evicting unlocked cache first if needed; None if they cannot be found."""
        while (pages := self.s.alloc.alloc(n, first)) is None:
            if not self.s.cache.evict(max(self.s.alloc.shortfall(n, first), self.evict_batch)):
                return None
        return pages

    def extend(self, req: Req, pages: list[int], ops: list[Op]) -> None:
        req.pages.extend(pages)
        req.private.update(pages)
        ops.append(ExtendPages(req.slot, pack_ids(pages)))  # type: ignore[arg-type]

    def publish(self, req: Req, kv_tokens: int) -> None:
        """Put req's full pages (KV written by now or by a step already sent) in the tree."""
        s = self.s
        if not s.cfg.enable_radix:
            return
        full = min(kv_tokens, req.num_known) // s.cfg.page_size
        if full == 0:
            return
        tokens = req.all_ids[: full * s.cfg.page_size]
        present, node = s.cache.insert_node(tokens, req.pages[:full])
        req.private.difference_update(req.pages[present // s.cfg.page_size : full])
        s.cache.lock(node)
        if req.node is not None:
            s.cache.unlock(req.node)
        req.node = node

    def trim(self, req: Req, rejected: int) -> None:
        """Speculative decoding: req's KV ends `rejected` tokens before what its verify row
        wrote; the pages past its new length (reserved for rejected drafts, private: never in
        the tree, which holds only accepted tokens) are freed, and TrimReq tells every replica."""
        if rejected <= 0:
            return
        req.kv_len -= rejected
        keep = -(-req.kv_len // self.s.cfg.page_size)
        surplus = req.pages[keep:]
        if not surplus:
            return
        del req.pages[keep:]
        req.private.difference_update(surplus)
        self.s.alloc.free(sorted(surplus))
        self.s.pending_ops.append(TrimReq(req.slot, keep))  # type: ignore[arg-type]

    def release(self, req: Req) -> None:
        """Free the pages only req holds and unlock its tree path."""
        if req.private:
            self.s.alloc.free(sorted(req.private))
        if req.node is not None:
            self.s.cache.unlock(req.node)
        req.private, req.pages, req.node, req.kv_len = set(), [], None, 0

    def release_slot(self, req: Req, ops: list[Op]) -> None:
        if req.slot is not None:
            ops.append(FreeReq(req.slot))
            heapq.heappush(self.s.free_slots, req.slot)
            req.slot = None
