"""Channel scheduler -> tokenizer: new tokens per request, readiness and stats."""

from __future__ import annotations

import msgspec


class ReqOutput(msgspec.Struct, frozen=True):
    rid: str
    new_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[float] | None = None  # one per new id
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per new id: (token, logprob)
    # with the first output, SamplingParams.prompt_logprobs: prompt tokens 1.. (the first has none)
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    # speculative decoding, cumulative for the request: (verify rows, drafts proposed, drafts accepted)
    spec: tuple[int, int, int] | None = None


class TokenBatch(msgspec.Struct, tag=True, frozen=True):
    outs: list[ReqOutput]


class SchedulerStats(msgspec.Struct, tag=True, frozen=True):
    """Gauges and counters for /metrics, sent when ready and then whenever they change
    (at most every ~100 ms). The first one with ready=True means every worker is up."""

    ready: bool
    max_context: int  # longest prompt + output a request may have, in tokens
    vocab_size: int
    kv_pages_total: int
    kv_pages_used: int  # held by requests or by the prefix cache
    cache_pages: int  # held by the prefix cache (reusable, evictable when unlocked)
    running: int
    waiting: int
    cache_hit_tokens: int  # cumulative prompt tokens served from the prefix cache, every tier (L1 + L2 + L3)
    step_seconds: list[float]  # durations of steps finished since the previous stats
    leak_free: bool = True  # result of the last idle leak check
    deterministic: bool = False  # every worker runs deterministic inference (GET /health says so)
    dropped_frames: dict[str, int] = {}  # malformed frames the scheduler dropped, per channel
    # an MoE model's cumulative routed (token, expert) pairs, {layer id: per expert}, when new
    # since the previous stats (engine/run/expert_counts.py)
    expert_tokens: dict[int, list[int]] | None = None
    # context parallelism (--cp-size > 1): pages used in each cp rank's pool (the owner of a page)
    kv_pages_used_by_cp_rank: list[int] | None = None
    eos_token_ids: list[int] = []  # the model's end tokens (the edge's min_tokens x allowed_token_ids check)
    evictable_pages: int = 0  # of cache_pages, those no running request holds (free at need)
    # the host tier (L2), when on: cumulative counters and its pages
    l2_hit_tokens: int = 0  # prompt tokens loaded back from L2 instead of recomputed
    l2_pages_used: int = 0
    l2_pages_total: int = 0
    backups_committed: int = 0
    backups_skipped: int = 0  # L2 full even after evict-to-fit
    load_backs: int = 0
    # the disk tier (L3, --l3-dir), when on: cumulative counters and the directory's size
    l3_hit_tokens: int = 0  # prompt tokens read from L3 files (into L2, then L1) instead of recomputed
    l3_reads: int = 0  # page files read and verified
    l3_writes: int = 0  # page files written
    l3_bytes_read: int = 0
    l3_bytes_written: int = 0
    l3_corrupt: int = 0  # files rejected (header, length, checksum, foreign model) and removed
    l3_write_skips: int = 0  # writes skipped (writer queue over its byte bound)
    l3_files: int = 0  # files in the directory (as the controller sees it)
    l3_bytes: int = 0  # their bytes
    # speculative decoding, when on: cumulative verify rows by drafts accepted (index 0: none), and
    # verify rows answered with no draft at all (the lookup found none)
    spec_accept_hist: list[int] = []
    spec_empty_rows: int = 0
    spec_drafted: int = 0  # cumulative draft tokens proposed to verify rows (accepted: spec_accept_hist)
    retractions: int = 0  # cumulative: running requests whose KV was given back for lack of pages (re-prefilled)


class FlushDone(msgspec.Struct, tag=True, frozen=True):
    """The answer to FlushCache `id`: done, or refused with the reason (requests in flight)."""

    id: int
    ok: bool
    message: str = ""


ToTokenizer = TokenBatch | SchedulerStats | FlushDone
