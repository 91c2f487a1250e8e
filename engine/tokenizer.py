"""The tokenizer as the front end sees it: encode, decode, token text, chat template; and the
xgrammar TokenizerInfo that the tokenizer process and every worker build from the same files.
Below both engine/serve and engine/run (tests/engine/test_layering.py).

`load_tokenizer(model_dir)` returns None for a directory without tokenizer files (random
weight benchmark dirs): the server then runs in ids-only mode. Decoding goes straight to
the Rust `tokenizers` backend when there is one: it is ~3x cheaper per call than the
transformers wrapper and the incremental detokenizer calls it twice per output batch.
"""

from __future__ import annotations

import functools
import json
import zlib
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
        self._token_bytes: dict[int, bytes] = {}
        # byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM): a piece's characters stand for bytes
        self._byte_level = type(getattr(self._backend, "decoder", None)).__name__ == "ByteLevel"
        self._added = set(getattr(hf, "added_tokens_encoder", {}) or {})

    @property
    def chat_template(self) -> str | None:
        template = getattr(self.hf, "chat_template", None)
        return template if isinstance(template, str) and template else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def fewest_tokens(self, text: str) -> int:
        """A lower bound on len(encode(text)) from its length alone: no token stands for more
        characters than `max_piece_chars`. 0 where no bound holds."""
        longest = self.max_piece_chars
        return -(-len(text) // longest) if longest else 0

    @functools.cached_property
    def max_piece_chars(self) -> int:
        """The most characters of text one token stands for: its longest vocabulary piece (a
        byte-level piece's characters are bytes, no fewer than the text's characters; `▁` is one
        space; `<0xE2>` less than one character). 0 (no bound) where one token can stand for any
        amount of text (`_bounded`), or the tokenizer is not a fast one."""
        if self._backend is None or not _bounded(json.loads(self._backend.to_str())):
            return 0
        return max((len(piece) for piece in self.hf.get_vocab()), default=0)

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

    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes one token stands for: a byte-level piece's bytes, a byte-fallback
        piece's (`<0xE2>`) byte, else its text's (sentencepiece's `▁` as a space). A character
        split over tokens has part of its bytes in each (OpenAI's logprobs `bytes`)."""
        data = self._token_bytes.get(token_id)
        if data is None:
            data = self._bytes_of(token_id)
            self._token_bytes[token_id] = data
        return data

    def _bytes_of(self, token_id: int) -> bytes:
        piece = self.hf.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and piece not in self._added:
            byte_of = _byte_level_bytes() if self._byte_level else {}
            if byte_of and all(c in byte_of for c in piece):
                return bytes(byte_of[c] for c in piece)
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                try:
                    return bytes([int(piece[3:5], 16)])
                except ValueError:
                    pass
            if "\u2581" in piece:
                return piece.replace("\u2581", " ").encode()
        return self.token_text(token_id).encode()


def _bounded(spec: dict[str, Any]) -> bool:
    """Whether no token of a tokenizer.json can stand for more text than its piece's characters:
    no normalizer or pre-tokenizer step that deletes characters, no added token that swallows the
    whitespace beside it (lstrip / rstrip), and no model that turns a run of unknown text into one
    token (WordPiece, WordLevel, a Unigram without byte fallback, a BPE that fuses unknowns)."""
    model = spec.get("model") or {}
    kind = model.get("type")
    if kind not in ("BPE", "Unigram") or (kind == "Unigram" and not model.get("byte_fallback")):
        return False
    if kind == "BPE" and model.get("fuse_unk") and not model.get("byte_fallback"):
        return False
    if any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens") or ()):
        return False
    return _keeps_characters(spec.get("normalizer")) and _splits_only(spec.get("pre_tokenizer"))


def _splits_only(pre: dict[str, Any] | None) -> bool:
    """Whether a pre-tokenizer only splits text (or marks spaces), never removing any of it."""
    if pre is None:
        return True
    kind = pre.get("type")
    if kind == "Sequence":
        return all(_splits_only(p) for p in pre.get("pretokenizers", []))
    if kind in ("Split", "Punctuation"):
        return pre.get("behavior") != "Removed"
    return kind in ("ByteLevel", "Metaspace", "Digits", "UnicodeScripts")


def _keeps_characters(normalizer: dict[str, Any] | None) -> bool:
    """Whether a tokenizers normalizer never removes characters: none, or only Prepend,
    Lowercase and one-character replacements (sentencepiece's space to `▁`)."""
    if normalizer is None:
        return True
    kind = normalizer.get("type")
    if kind == "Sequence":
        return all(_keeps_characters(n) for n in normalizer.get("normalizers", []))
    if kind == "Replace":
        pattern = normalizer.get("pattern", {})
        return len(pattern.get("String") or "") == 1 and bool(normalizer.get("content"))
    return kind in ("Prepend", "Lowercase")


@functools.cache
def _byte_level_bytes() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character that stands for each byte -> the byte."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}


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
    """The template text of a --chat-template file, compiled: the supervisor calls this before any
    process starts (engine/config.check_before_start), so a bad file is exit 2, not a failure after
    the weights have loaded; a ValueError names the file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--chat-template {path}: not a readable UTF-8 file ({exc})") from None
    if not text.strip():
        raise ValueError(f"--chat-template {path}: the file is empty")
    problem = chat_template_problem(text)
    if problem is not None:
        raise ValueError(f"--chat-template {path}: {problem}")
    return text


def chat_template_problem(text: str) -> str | None:
    """Why a chat template's text does not compile in jinja's sandbox (the environment transformers
    renders it in), or None: for --chat-template's file and a request's own template
    (engine/serve/chat.request_template)."""
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment().parse(text)
    except TemplateSyntaxError as exc:
        return f"does not compile: {exc} (line {exc.lineno})"
    return None


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


def grammar_data(source: str) -> bytes:
    """`msgs.params.Grammar.data` of a structural tag's JSON (as engine/serve/grammar.py
    `compilable` makes it): the source every rank compiles, never a compiled form."""
    return zlib.compress(source.encode(), 6)


def grammar_compiler(info: Any, threads: int) -> Any:
    """The xgrammar GrammarCompiler a rank compiles its grammars with (cached by key by the
    caller, so none in xgrammar)."""
    import xgrammar as xgr

    return xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)


def compile_grammar(compiler: Any, data: bytes) -> Any:
    """The CompiledGrammar of a Grammar's data: the same on every rank (the same xgrammar, the
    same TokenizerInfo from the same tokenizer files, the same source)."""
    return compiler.compile_structural_tag(zlib.decompress(data).decode())
