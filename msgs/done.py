"""Channel workers -> scheduler: step completions and worker readiness."""

from __future__ import annotations

import msgspec


class StepDone(msgspec.Struct, tag=True, frozen=True):
    """Result of Step `seq` on `rank`. Sampled arrays follow the order of the forward's
    requests that had sample=1. Only rank 0 fills them."""

    seq: int
    rank: int
    token_ids: bytes = b""  # packed int32
    logprobs: bytes | None = None  # packed f32
    top_ids: bytes | None = None  # packed int32, [n, top_k] row-major
    top_logprobs: bytes | None = None  # packed f32
    top_k: int = 0
    # Forward.prompt's rows, row after row: the logprob of each scored token ([n]), its top_k
    prompt_logprobs: bytes | None = None  # packed f32
    prompt_top_ids: bytes | None = None  # packed int32 [n, prompt_top_k]
    prompt_top_logprobs: bytes | None = None  # packed f32
    prompt_top_k: int = 0
    digest: str | None = None  # at a DigestCheck: the replica's digest after this step's ops
    tokens_hash: str | None = None  # at a DigestCheck: SHA-256 chain of every token sampled so far
    forward_s: float = 0.0
    # rank 0, an MoE model, at most once a second and when a batch drained: cumulative routed
    # (token, expert) pairs, {layer id: per expert} (engine/run/expert_counts.py)
    expert_tokens: dict[int, list[int]] | None = None


class SpecDone(StepDone):
    """StepDone of a step that verified drafts (Forward.drafts): `token_ids` (and the logprob
    arrays) hold every answered token, request-major, and `accepted` (packed int32, one per
    sampled request) how many of its drafts were accepted: it answered accepted + 1 tokens
    (the last one the bonus token, sampled from the target); -1 for a chained row whose
    previous row did not accept every draft (Drafts.chained): it answered nothing. A step
    without drafts answers a plain StepDone (the same bytes as without speculation)."""

    accepted: bytes = b""


class GrammarReady(msgspec.Struct, tag=True, frozen=True):
    """Rank `rank` compiled the grammar of PrepareGrammar number `generation` (GrammarKeys.prepared
    after it: a count every replica agrees on, so a report on a grammar prepared again is told
    apart); `error` when it did not compile (every request waiting on it fails)."""

    rank: int
    key: str
    generation: int
    error: str = ""


class WorkerReady(msgspec.Struct, tag=True, frozen=True):
    rank: int
    num_pages: int
    page_size: int
    max_context: int
    vocab_size: int
    eos_token_ids: list[int]
    page_bytes: int = 0  # one KV page across every layer, K and V: a host-tier page
    num_layers: int = 0  # layers of that page (the L3 files' layout)
    l3_fingerprint: bytes = b""  # with --l3-dir: the model's L3 fingerprint (engine/cache/l3.py)
    deterministic: bool = False  # --enable-deterministic-inference (every rank must agree)
    kv_components: int = 2  # KV layout components a layer caches (K and V: 2; MLA's latent: 1)
    device_type: str = ""  # cpu | cuda: the scheduler's device-dependent defaults (--batch-wait-ms)


class WorkerFailed(msgspec.Struct, tag=True, frozen=True):
    rank: int
    seq: int
    reason: str


FromWorker = StepDone | SpecDone | GrammarReady | WorkerReady | WorkerFailed


# ---- the cache controller (host tier) ---------------------------------------------------


class BackupDone(msgspec.Struct, tag=True, frozen=True):
    """Worker -> cache controller: rank `rank` copied object `obj` to the host slab."""

    obj: int
    rank: int


class Committed(msgspec.Struct, tag=True, frozen=True):
    """Cache controller -> scheduler: every rank backed `obj` up; the scheduler re-publishes
    it as ApplyCommit, so every replica sees the commit at one place in the stream."""

    obj: int


class ControllerDigest(msgspec.Struct, tag=True, frozen=True):
    """Cache controller -> scheduler: its replica's digest after step `seq` (a DigestCheck)."""

    seq: int
    digest: str


class ControllerFailed(msgspec.Struct, tag=True, frozen=True):
    reason: str


class L3Loaded(msgspec.Struct, tag=True, frozen=True):
    """Cache controller -> scheduler: the L3Load of `obj` is done; ok: every page was read
    and verified into the host slab (re-published as ApplyCommit), else the object is
    dropped (HostEvict) and its request recomputes."""

    obj: int
    ok: bool


class L3Stats(msgspec.Struct, tag=True, frozen=True):
    """Cache controller -> scheduler (at most once a second, when changed): the disk tier's
    cumulative counters and the directory's size as the controller sees it."""

    reads: int = 0
    writes: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    corrupt: int = 0
    write_skips: int = 0
    files: int = 0
    bytes: int = 0


ToController = BackupDone
FromController = Committed | ControllerDigest | ControllerFailed | L3Loaded | L3Stats
