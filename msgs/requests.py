"""Channel tokenizer -> scheduler: tokenized requests and aborts."""

from __future__ import annotations

import msgspec

from msgs.params import SamplingParams


class TokenizedRequest(msgspec.Struct, tag=True, frozen=True):
    rid: str
    input_ids: bytes  # packed int32
    params: SamplingParams


class AbortRequest(msgspec.Struct, tag=True, frozen=True):
    rid: str


ToScheduler = TokenizedRequest | AbortRequest
