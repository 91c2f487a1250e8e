"""Channel tokenizer -> scheduler: tokenized requests, aborts, cache flushes."""

from __future__ import annotations

import msgspec

from msgs.params import SamplingParams


class TokenizedRequest(msgspec.Struct, tag=True, frozen=True):
    rid: str
    input_ids: bytes  # packed int32
    params: SamplingParams


class AbortRequest(msgspec.Struct, tag=True, frozen=True):
    rid: str


class FlushCache(msgspec.Struct, tag=True, frozen=True):
    """Empty every cache tier (POST /flush_cache); answered by a FlushDone with the same id."""

    id: int


ToScheduler = TokenizedRequest | AbortRequest | FlushCache
