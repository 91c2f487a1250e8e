"""Channel client <-> tokenizer (the ZMQ SDK, tcp): generate requests and their replies.

The client (a DEALER) sends ToServer; the tokenizer's ROUTER answers with FromServer,
routed back by the connection's identity.
"""

from __future__ import annotations

import msgspec

from msgs.params import SamplingParams

# the largest frame the server reads (its zmq.MAXMSGSIZE; HTTP's body limit too): a larger one is
# refused by zmq and its connection dropped, so the SDK answers 413 before sending it
MAX_FRAME_BYTES = 64 << 20


class GenerateRequest(msgspec.Struct, tag=True, frozen=True):
    rid: str
    params: SamplingParams
    text: str | None = None
    input_ids: list[int] | None = None
    stream: bool = False
    api_key: str = ""  # the server's --api-key, where it has one
    # of params.MODEL_DEFAULT_FIELDS, those the caller left unset: the server's model defaults apply
    # (--sampling-defaults model). A client that sends none gets exactly the params it sent.
    unset: list[str] = []
    # False: the caller set no max_new_tokens (or None: up to the context's end), so the server clips
    # it to the context left, as /generate does; a client that sends none asks for params' exactly
    max_given: bool = True


class AbortGenerate(msgspec.Struct, tag=True, frozen=True):
    rid: str


class GenerateChunk(msgspec.Struct, tag=True, frozen=True):
    """A streamed delta, or with stream=False the whole result in one chunk."""

    rid: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[float] | None = None
    prompt_logprobs: list[float] | None = None  # prompt_logprobs: prompt tokens 1.. (in the first chunk)
    top_logprobs: list[list[tuple[int, float]]] | None = None  # top_logprobs: (id, logprob) per output token
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None  # per prompt token 1.., with prompt_logprobs


class KeepAlive(msgspec.Struct, tag=True, frozen=True):
    """Sent about once a second while a request runs and nothing else was sent to it (a non-streamed
    one, a stream in a long prefill): a send to a client that is gone fails, so the server learns of
    it and aborts the request; a client that hears nothing at all for a while knows the server is
    gone (msgs/sdk.py: SILENCE_S). Clients skip it otherwise."""

    rid: str


class GenerateError(msgspec.Struct, tag=True, frozen=True):
    rid: str
    status: int
    message: str


ToServer = GenerateRequest | AbortGenerate
FromServer = GenerateChunk | GenerateError | KeepAlive
