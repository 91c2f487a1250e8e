"""vLLM's POST /tokenize and /detokenize and GET /tokenizer_info: the front end's tokenizer, no
scheduler step (lm-evaluation-harness's remote tokenizer uses exactly these three).

/tokenize answers {"count", "max_model_len", "tokens", "token_strs"} for a `prompt` (special
tokens added unless `add_special_tokens` is false) or chat `messages` (the chat endpoint's
rendering and ids: the same template, kwargs and tools); /detokenize answers {"prompt"}.
"""

from __future__ import annotations

from engine.serve.chat import chat_text, request_template
from engine.serve.errors import ApiError
from engine.serve.parsers.tool_request import check_tools
from engine.serve.protocol import DetokenizeBody, TokenizeBody, decode_body
from engine.serve.state import Call, Reply, ServeState
from engine.serve.validate import IDS_ONLY, check_model, off_loop
from engine.tokenizer import TextTokenizer


async def tokenize(state: ServeState, body: bytes, call: Call) -> Reply:
    req = decode_body(body, TokenizeBody)
    check_model(req.model, state.accepted_models)
    if (req.prompt is None) == (req.messages is None):
        raise ApiError(400, "give exactly one of prompt and messages", param="prompt")
    if state.tok is None:
        raise ApiError(400, f"tokenize is not available: {IDS_ONLY}", param="prompt")
    limits = await state.limits()
    if req.messages is not None:
        check_tools(req.tools, None, None, state.cfg.tool_call_parser)  # the chat endpoint's checks: same render
        template = request_template(req.chat_template, state.cfg.trust_request_chat_template)
        text = await off_loop(len(body), chat_text, state.tok, req.messages, req.tools, req.chat_template_kwargs,
                              add_generation_prompt=req.add_generation_prompt,
                              continue_final_message=req.continue_final_message, template=template)
        ids = await off_loop(len(body), state.tok.encode, text, add_special_tokens=bool(req.add_special_tokens))
    else:
        ids = await off_loop(len(body), state.tok.encode, req.prompt or "",
                             add_special_tokens=req.add_special_tokens is not False)
    strs = await off_loop(len(body), state.tok.hf.convert_ids_to_tokens, ids) if req.return_token_strs else None
    return Reply(body={"count": len(ids), "max_model_len": limits.max_context, "tokens": ids, "token_strs": strs})


async def tokenizer_info(state: ServeState, body: bytes, call: Call) -> Reply:
    """The tokenizer's special tokens, chat template and class (vLLM's /tokenizer_info)."""
    if state.tok is None:
        raise ApiError(400, f"tokenizer_info is not available: {IDS_ONLY}")
    hf = state.tok.hf
    names = ("eos_token", "bos_token", "pad_token", "unk_token")
    info = {name: getattr(hf, name, None) for name in names}
    info.update(tokenizer_class=type(hf).__name__, chat_template=state.tok.chat_template,
                model_max_length=(await state.limits()).max_context)
    return Reply(body={k: v if v is None or isinstance(v, int | str) else str(v) for k, v in info.items()})


async def detokenize(state: ServeState, body: bytes, call: Call) -> Reply:
    req = decode_body(body, DetokenizeBody)
    check_model(req.model, state.accepted_models)
    if state.tok is None:
        raise ApiError(400, f"detokenize is not available: {IDS_ONLY}", param="tokens")
    vocab = (await state.limits()).vocab_size
    # off the loop when long: a 30M-id body checked and decoded inline stalled every client ~7 s
    return Reply(body={"prompt": await off_loop(len(body), _detokenize, state.tok, req.tokens, vocab)})


def _detokenize(tok: TextTokenizer, ids: list[int], vocab: int) -> str:
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise ApiError(400, f"token id {bad} is out of range for the vocabulary (size {vocab})", "tokens")
    return tok.decode(ids, skip_special_tokens=False)
