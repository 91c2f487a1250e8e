"""Request bodies of the HTTP API as msgspec Structs, decoded strictly.

Unknown top-level fields are rejected (a typo must not be silently ignored). OpenAI's fields
and vLLM's and SGLang's extensions are declared: those this server implements are honoured,
pure hints (prompt_cache_key, safety_identifier, verbosity, user) are accepted and ignored, and
the rest pass with their harmless values (None, false, the default) while `check_unsupported`
names them otherwise (REFUSED).
Messages are lenient on extra keys: clients echo back assistant messages with fields
like `refusal` or `annotations`.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

import msgspec

from engine.serve.errors import ApiError, from_validation

T = TypeVar("T")


_NULL_MEANS_DEFAULT = {
    "n": 1,
    "stream": False,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "echo": False,
    "add_generation_prompt": True,
    "continue_final_message": False,
    "separate_reasoning": True,
    "include_reasoning": True,
}


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: str
    # UNSET (the key is absent) differs from null: only an assistant turn may omit it.
    content: str | list[ContentPart] | None | msgspec.UnsetType = msgspec.UNSET
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class StructuredOutputs(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM's `structured_outputs` (which replaced its guided_* fields in v0.12): one constraint."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None  # {"structures": [...], "triggers": [...]} as JSON text


class _Sampling(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = 1  # None (JSON null) becomes the default in __post_init__, as below
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Extensions (vLLM / SGLang names).
    min_tokens: int | None = None
    prompt_logprobs: int | None = None  # vLLM's: not with stream
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    regex: str | None = None  # constrained decoding (engine/serve/grammar.py)
    ebnf: str | None = None
    # vLLM's names for the same (validate.guided_spec): a JSON Schema, a regex, one of some strings, EBNF
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM >= 0.12's name for the four above
    # OpenAI's hints, accepted and not used (on completions too, as vLLM ignores them there)
    prompt_cache_key: str | None = None  # cache routing: one server's prefix cache needs none
    safety_identifier: str | None = None  # an end-user id (as `user`)
    verbosity: Literal["low", "medium", "high"] | None = None  # for OpenAI's own models
    request_id: str | None = None  # vLLM's: the request's id (an x-request-id header wins)
    rid: str | None = None  # SGLang's name for it
    no_stop_trim: bool | None = None  # SGLang's name for include_stop_str_in_output
    add_special_tokens: bool | None = None  # vLLM's: None is true for a prompt, false for chat messages
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the last k prompt tokens (-1: the context's)
    allowed_token_ids: list[int] | None = None  # vLLM's: sample among these tokens only
    priority: int | None = None  # vLLM's: with --scheduling-policy priority, lower first
    bad_words: list[str] | None = None  # vLLM's: words never generated
    return_tokens_as_token_ids: bool | None = None  # vLLM's: logprobs name tokens "token_id:<id>"
    # declared for REFUSED: accepted at their harmless values only
    length_penalty: Any = None
    use_beam_search: Any = None
    spaces_between_special_tokens: Any = None
    lora_path: Any = None
    return_hidden_states: Any = None

    def __post_init__(self) -> None:
        # Some clients send every field, unset ones as null: null means the default.
        for name in _NULL_MEANS_DEFAULT:
            if getattr(self, name, 0) is None:
                setattr(self, name, _NULL_MEANS_DEFAULT[name])


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: list[ChatMessage]
    response_format: dict[str, Any] | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's, for reasoning models: handed to the chat template (as vLLM does; gpt-oss's reads it)
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None
    separate_reasoning: bool | None = True  # SGLang's: false leaves the reasoning in the content
    include_reasoning: bool | None = True  # vLLM's: false leaves it out of the answer
    add_generation_prompt: bool | None = True  # vLLM's chat extensions
    continue_final_message: bool | None = False
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    modalities: list[str] | None = None
    # OpenAI's predicted output ({"type": "content", "content": text or text parts}): a latency hint, never a
    # change of the answer (NGRAM drafts from it: validate.prediction_ids)
    prediction: Any = None
    # declared for REFUSED
    audio: Any = None
    functions: Any = None
    function_call: Any = None
    web_search_options: Any = None
    chat_template: str | None = None  # vLLM's: this request's Jinja template (--trust-request-chat-template)
    documents: Any = None
    echo: Any = None
    stream_reasoning: Any = None


class CompletionRequest(_Sampling, kw_only=True):
    # str | list[str] | list[int] | list[list[int]]: msgspec allows one array type in a
    # union, so the array shapes are checked by `completion_prompts`.
    prompt: str | list[Any]
    logprobs: int | None = None
    response_format: dict[str, Any] | None = None  # not OpenAI's here; vLLM's and SGLang's
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None


class ResponsesRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """OpenAI's /v1/responses, stateless: the conversation comes whole in `input` (a text, or its
    items: messages, function calls and their outputs), and nothing is kept after the answer
    (engine/serve/responses.py maps it onto the chat path)."""

    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None  # {"format": text / json_object / json_schema, "verbosity": a hint}
    reasoning: dict[str, Any] | None = None  # {"effort": ..., "summary": a hint}
    include: list[str] | None = None
    # accepted, nothing kept: store says whether OpenAI would keep the response (this server keeps none)
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    # vLLM's extensions of this endpoint
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    ignore_eos: bool | None = None  # (benchmarks: an answer of exactly max_output_tokens)
    request_id: str | None = None
    priority: int | None = None
    top_logprobs: int | None = None  # with include's message.output_text.logprobs, or alone (vLLM)
    # declared for a clear 400 (responses.chat_request): state this server does not keep, and the rest
    previous_response_id: Any = None
    conversation: Any = None
    background: Any = None
    prompt: Any = None
    max_tool_calls: Any = None


class GenerateBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """SGLang-native /generate. sampling_params stays a dict until `native_params` so
    that the defaults the client did not set can be told apart."""

    text: str | list[str] | None = None  # a list: a batch
    input_ids: list[Any] | None = None  # token ids, or a list of them (a batch): checked in engine.serve.native
    sampling_params: dict[str, Any] | None = None
    stream: bool = False
    rid: str | None = None
    # SGLang's logprob fields (engine.serve.native)
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False


class AbortBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """SGLang's POST /abort_request: one request by its id, or every request (`abort_all`)."""

    rid: str = ""
    abort_all: bool = False


class TokenizeBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM's /tokenize: a `prompt`, or chat `messages` rendered as /v1/chat/completions would."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # None: true for a prompt, false for messages (as vLLM)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # as the chat endpoint's (--trust-request-chat-template)
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False


class DetokenizeBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM's /detokenize."""

    model: str | None = None
    tokens: list[int]


_DECODERS = {t: msgspec.json.Decoder(t) for t in (ChatCompletionRequest, CompletionRequest, ResponsesRequest,
                                                  GenerateBody, TokenizeBody, DetokenizeBody, AbortBody)}


def decode_body(body: bytes, kind: type[T]) -> T:
    """Decode a JSON body into `kind`, or raise a 400 naming the offending field."""
    if not body.strip():
        raise ApiError(400, "request body is empty; expected a JSON object")
    try:
        return _DECODERS[kind].decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise from_validation(exc) from None
    except RecursionError:  # msgspec's depth limit: arrays or objects nested ~1000 deep
        raise ApiError(400, "invalid JSON: nested too deeply") from None


# field -> (its harmless values, why the rest are refused): features this server does not have (both
# endpoints', then chat's)
REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "length_penalty": ((None, 1, 1.0), "length_penalty applies to beam search, which is not supported"),
    "use_beam_search": ((None, False), "beam search is not supported"),
    "spaces_between_special_tokens": ((None, True), "spaces_between_special_tokens false is not supported"),
    "lora_path": ((None,), "LoRA adapters are not supported"),
    "return_hidden_states": ((None, False), "return_hidden_states is not supported"),
}
REFUSED_IN_CHAT: dict[str, tuple[tuple[Any, ...], str]] = {
    "audio": ((None,), "audio output is not supported (text only)"),
    "functions": ((None,), "functions is deprecated and not supported: use tools"),
    "function_call": ((None,), "function_call is deprecated and not supported: use tool_choice"),
    "web_search_options": ((None,), "web search is not supported"),
    "documents": ((None,), "documents is not supported"),
    "echo": ((None, False), "echo is a /v1/completions feature; chat does not echo"),
    "stream_reasoning": ((None, True), "stream_reasoning false is not supported"),
}
_REFUSED_IN_CHAT = REFUSED | REFUSED_IN_CHAT


def refuse(req: Any, refused: dict[str, tuple[tuple[Any, ...], str]]) -> None:
    """A 400 naming the first field of `refused` (name -> (its harmless values, why)) that `req` sets
    to another value."""
    for name, (harmless, why) in refused.items():
        value = getattr(req, name)
        if not any(value == h and type(value) is type(h) for h in harmless):  # (0 == False: not the same here)
            raise ApiError(400, why, param=name)


def check_unsupported(req: ChatCompletionRequest | CompletionRequest) -> None:
    """Reject OpenAI features this server does not implement, when asked for for real."""
    refuse(req, REFUSED if isinstance(req, CompletionRequest) else _REFUSED_IN_CHAT)
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "stream_options is only allowed when stream is true", param="stream_options")
    if req.prompt_logprobs is not None and req.stream:  # (as vLLM)
        raise ApiError(400, "prompt_logprobs is not available with stream", param="prompt_logprobs")
    fmt = (req.response_format or {}).get("type", "text")
    # the rest: engine.serve.grammar.response_format_spec
    if fmt not in ("text", "json_object", "json_schema", "structural_tag"):
        raise ApiError(400, f"response_format type {fmt!r} is not supported", param="response_format")
    if isinstance(req, CompletionRequest):
        _check_completion_extras(req)
    else:
        _check_chat_extras(req)


def _check_completion_extras(req: CompletionRequest) -> None:
    if req.suffix:
        raise ApiError(400, "suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise ApiError(400, "best_of other than n is not supported", param="best_of")


def _check_chat_extras(req: ChatCompletionRequest) -> None:
    if req.modalities not in (None, ["text"]):
        raise ApiError(400, "only the text modality is supported", param="modalities")
    # tools / tool_choice / parallel_tool_calls: engine.serve.parsers.tool_request.check_tools,
    # which needs the server's --tool-call-parser.
