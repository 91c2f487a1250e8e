"""The tokenizer as the front end sees it: encode, decode, token text, chat template; and the
xgrammar TokenizerInfo that the tokenizer process and every worker build from the same files.
Below both engine/serve and engine/run (tests/engine/test_layering.py).

`load_tokenizer(model_dir)` returns None for a directory without tokenizer files (random
weight benchmark dirs): the server then runs in ids-only mode. Decoding goes straight to
the Rust `tokenizers` backend when there is one: it is ~3x cheaper per call than the
transformers wrapper and the incremental detokenizer calls it twice per output batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import structlog

log = structlog.get_logger()
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class Decoder(Protocol):
    """The one call the detokenizer needs (a `tokenizers.Tokenizer` satisfies it)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class TextTokenizer:
    """Wraps a transformers tokenizer; owns the per-id token text cache for logprobs."""

    def __init__(self, hf: Any) -> None:
        self.hf = hf
        self._backend = getattr(hf, "backend_tokenizer", None)
        self._token_text: dict[int, str] = {}

    @property
    def chat_template(self) -> str | None:
        template = getattr(self.hf, "chat_template", None)
        return template if isinstance(template, str) and template else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The text of one token on its own (logprobs); a partial UTF-8 byte shows as U+FFFD."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self.decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = text
        return text


def has_tokenizer_files(model_dir: str) -> bool:
    path = Path(model_dir)
    return any((path / name).is_file() for name in TOKENIZER_FILES)


def load_tokenizer(model_dir: str, chat_template: str = "") -> TextTokenizer | None:
    """Load the tokenizer of an HF-style directory, or None when it has no tokenizer files.

    `chat_template`: a Jinja file that replaces the model's template (--chat-template).
    Raises on a directory that does not exist, tokenizer files that fail to load or a
    template that does not compile: the caller reports that as a fatal startup error
    rather than silently going ids-only or failing every chat request later."""
    tok = _load(model_dir)
    if chat_template:
        if tok is None:
            raise ValueError(f"--chat-template given, but {model_dir!r} has no tokenizer files")
        tok.hf.chat_template = read_chat_template(chat_template)
    return tok


def read_chat_template(path: str) -> str:
    """The template text of a --chat-template file, compiled once to fail at startup."""
    text = Path(path).read_text()
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment().parse(text)
    except TemplateSyntaxError as exc:
        raise ValueError(f"chat template {path} does not compile: {exc} (line {exc.lineno})") from None
    return text


def _load(model_dir: str) -> TextTokenizer | None:
    if not model_dir:
        raise ValueError("no model directory given (cfg.model is empty; the supervisor must resolve it)")
    if not Path(model_dir).is_dir():
        raise ValueError(f"model directory {model_dir!r} does not exist")
    if not has_tokenizer_files(model_dir):
        return None
    # The fast-tokenizer class, not AutoTokenizer: AutoTokenizer's module imports torch,
    # which this process must not pay for. Every modern checkpoint ships tokenizer.json.
    from transformers import PreTrainedTokenizerFast

    try:
        return TextTokenizer(PreTrainedTokenizerFast.from_pretrained(model_dir))
    except (OSError, ValueError, TypeError) as exc:
        # A sentencepiece-only directory needs AutoTokenizer's conversion (and torch).
        log.warning("fast tokenizer failed to load, falling back to AutoTokenizer", error=str(exc))
        from transformers import AutoTokenizer

        return TextTokenizer(AutoTokenizer.from_pretrained(model_dir))


def tokenizer_info(hf_tokenizer: Any, vocab_size: int) -> Any:
    """The xgrammar TokenizerInfo of a model: its tokenizer, the model's vocabulary size
    (>= the tokenizer's; the extra ids are never allowed), stop tokens detected from the
    tokenizer. The tokenizer process and every worker call this on the same files."""
    import xgrammar as xgr

    return xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size)
