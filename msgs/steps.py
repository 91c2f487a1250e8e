"""Channel scheduler -> workers: the numbered Step stream.

A Step is applied by every worker in seq order. Ops are the only way replicated state
(per-slot page tables and sampling state) changes; `forward` says what to compute.
Slots are small integers the scheduler assigns (lowest free first), used as row indices
on the worker.
"""

from __future__ import annotations

import msgspec

from msgs.params import Grammar


class WorkerSampling(msgspec.Struct, frozen=True):
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    seed: int  # always set: the scheduler draws one deterministically when the user gave none
    logprobs: bool
    top_logprobs: int
    logit_bias: dict[int, float] = {}  # token id -> bias added to its logit (SamplingParams.logit_bias)
    min_new_tokens: int = 0  # SamplingParams.min_new_tokens: min_stop_ids are masked before that many outputs
    min_stop_ids: list[int] = []  # what would stop it: EOS (unless ignore_eos) and stop_token_ids, not a grammar's
    allowed_token_ids: list[int] = []  # SamplingParams.allowed_token_ids, sorted, without repeats; empty: every token
    bad_words_ids: list[list[int]] = []  # SamplingParams.bad_words_ids: a sequence masks its last token after the rest


class AddReq(msgspec.Struct, tag=True, frozen=True):
    slot: int
    rid: str
    sampling: WorkerSampling
    prompt_ids: bytes  # packed int32, for the repetition penalty
    output_ids: bytes = b""  # packed int32: tokens generated before a retraction (penalty history)
    # The request's grammar (a matcher per rank; re-advanced over output_ids), or None: named by
    # its key, which every rank holds and compiled (PrepareGrammar); its data is not sent again.
    grammar: Grammar | None = None


class PrepareGrammar(msgspec.Struct, tag=True, frozen=True):
    """Every rank holds this grammar from now on (GrammarKeys, least recently used out) and
    compiles it in the background, then reports GrammarReady; the scheduler admits requests that
    use it only once every rank did, so no step waits for a compile (docs/architecture.md,
    Structured output: the grammar gate)."""

    grammar: Grammar  # with its data (the source every rank compiles)


class ExtendPages(msgspec.Struct, tag=True, frozen=True):
    slot: int
    pages: bytes  # packed int32, appended to the slot's page table


class FreeReq(msgspec.Struct, tag=True, frozen=True):
    slot: int


class TrimReq(msgspec.Struct, tag=True, frozen=True):
    """Speculative decoding: the slot's page table keeps its first `keep` pages; the rest
    (reserved for drafts that were rejected) return to the free pool, on every replica."""

    slot: int
    keep: int


class CachePages(msgspec.Struct, tag=True, frozen=True):
    """Pages enter the prefix cache (they hold a prompt prefix others may reuse)."""

    pages: bytes  # packed int32


class EvictPages(msgspec.Struct, tag=True, frozen=True):
    """Pages leave the prefix cache for the free pool (eviction)."""

    pages: bytes  # packed int32


class Flush(msgspec.Struct, tag=True, frozen=True):
    """The prefix cache is emptied (only when no request holds a slot)."""


class DigestCheck(msgspec.Struct, tag=True, frozen=True):
    """Every replica reports the digest of its replicated state, and a hash of every token
    it sampled so far, in this step's StepDone."""


# ---- the host tier (L2), docs/architecture.md, Tiers. Host objects are radix nodes' KV copies in the host
# slab; an object's id is its radix node's id, its pages one contiguous host range.


class HostInit(msgspec.Struct, tag=True, frozen=True):
    """The host tier exists with `num_pages` pages of `page_bytes` per rank (the first host op)."""

    num_pages: int
    page_bytes: int = 0  # one KV page across every layer (0: not given, e.g. in unit tests)
    num_layers: int = 0  # layers of a page ([layer][component] pieces): the cache controller's L3 files
    l3_fingerprint: bytes = b""  # the model's L3 fingerprint (engine/cache/l3.py); empty: no disk tier
    kv_components: int = 2  # KV layout components per layer (K and V: 2; MLA's latent: 1)


class BackupPrepare(msgspec.Struct, tag=True, frozen=True):
    """Object `obj` takes host pages [host_start, host_start + n) (first fit: every replica
    computes the same start and refuses a different one); workers copy `device_pages`
    there after this step's forward and report BackupDone to the cache controller."""

    obj: int
    device_pages: bytes  # packed int32, n pages, in the object's token order
    host_start: int
    keys: bytes = b""  # the pages' L3 keys, 16 bytes each (empty when the disk tier is off)
    parent: int = -1  # the host object of the node above, whose pages come before these in the L3 key chain


class ApplyCommit(msgspec.Struct, tag=True, frozen=True):
    """Every rank finished `obj`'s backup (the controller's Committed, re-published)."""

    obj: int


class HostSplit(msgspec.Struct, tag=True, frozen=True):
    """The radix node of `obj` split: its first `cut` pages become object `new_obj`."""

    obj: int
    cut: int
    new_obj: int


class LoadBack(msgspec.Struct, tag=True, frozen=True):
    """Copy committed object `obj` (at host_start, checked) into `device_pages` before the
    forward."""

    obj: int
    device_pages: bytes  # packed int32
    host_start: int


class L3Load(msgspec.Struct, tag=True, frozen=True):
    """Object `obj` takes host pages [host_start, host_start + n) (first fit, checked as for
    BackupPrepare), n = len(keys) / 16; the cache controller reads those pages' L3 files
    into them (every rank's part) and reports L3Loaded. Workers copy nothing."""

    obj: int
    host_start: int
    keys: bytes  # the pages' L3 keys, 16 bytes each
    parent: int = -1  # as BackupPrepare's


class L3Touch(msgspec.Struct, tag=True, frozen=True):
    """Committed object `obj` was used again (a request's prefix hit in L1 / L2, which reads no L3
    file): the cache controller stamps its L3 files and those of the chain above it as just used,
    so the disk tier's size cap keeps them. Changes no replicated state."""

    obj: int


class HostEvict(msgspec.Struct, tag=True, frozen=True):
    """Object `obj` leaves the host tier; its pages return to the free list."""

    obj: int


Op = (
    AddReq | PrepareGrammar | ExtendPages | FreeReq | TrimReq | CachePages | EvictPages | Flush | DigestCheck
    | HostInit | BackupPrepare | ApplyCommit | HostSplit | LoadBack | HostEvict | L3Load | L3Touch
)


class Drafts(msgspec.Struct, frozen=True):
    """Speculative rows of a Forward (docs/architecture.md, Speculative decoding). Arrays are
    packed int32, one entry per request of the forward unless noted.

    num_drafts: the last num_drafts input tokens of the row are draft tokens to verify (0: a
    plain row); its logits are taken at its last num_drafts + 1 tokens (the logit positions),
    and it answers between 1 and num_drafts + 1 tokens (the accepted drafts, then the bonus).
    parents: per draft token, request-major, the index among its row's drafts of the token it
    follows (-1: the row's first token; always an earlier draft), a chain's i - 1; empty: every
    row is a chain. A tree (--speculative-eagle-topk > 1) answers its longest accepted
    root-to-leaf path, then the bonus; never chained; with on_worker, a chain with leaves beside
    its nodes (the draft's next best tokens). on_worker: draft
    ids given as -1 are proposed on every rank by the draft model or head (STANDALONE, EAGLE,
    EAGLE3, NEXTN), not by the scheduler.
    chained: per request 1 when its row was planned before its previous verify row was answered,
    assuming that row accepts every draft (overlapped speculation): its first token is that
    row's bonus (a future reference) and its start follows the drafts. It counts only if they
    were all accepted; otherwise it answers nothing (accepted -1 in SpecDone). Empty: none."""

    num_drafts: bytes
    parents: bytes = b""
    on_worker: bool = False
    chained: bytes = b""


class PromptRows(msgspec.Struct, frozen=True):
    """Rows of a Forward whose every prompt token's logprob is wanted (SamplingParams.prompt_logprobs):
    the logits of all their tokens; the target of a row's last token is `next_ids`' entry (the
    prompt's next token; -1 when the row ends the prompt: that token is sampled, not scored)."""

    rows: bytes  # packed int32: indices into the Forward's requests
    next_ids: bytes  # packed int32, one per row
    top_k: int = 0  # top alternatives a token (the most any of these rows asks for)


class Forward(msgspec.Struct, frozen=True, omit_defaults=True):
    """One batch. Arrays are packed int32, one entry per request unless noted.

    input_ids holds every new token, request-major; -1 is a future reference: the token
    this slot sampled in the previous step, resolved on the worker's device. `drafts` is
    None without speculation (omitted on the wire: the same bytes as before it existed)."""

    slots: bytes
    input_ids: bytes  # per token
    start_pos: bytes  # KV length before this step
    extend_lens: bytes
    sample: bytes  # 1 when the request's last new token must be sampled
    drafts: Drafts | None = None  # speculative decoding: rows that verify draft tokens
    prompt: PromptRows | None = None  # rows scoring their prompt tokens (omitted when none)


class Step(msgspec.Struct, tag=True, frozen=True):
    seq: int
    ops: list[Op]
    forward: Forward | None = None


class Shutdown(msgspec.Struct, tag=True, frozen=True):
    pass


ToWorker = Step | Shutdown
