"""Incremental detokenization with stop strings, one `Detokenizer` per request.

Two layers:
- `IncrementalDecoder` turns new token ids into new text. It decodes a small window
  (a few emitted ids as context, plus the unread ids) and emits the new part, so the
  cost per call does not grow with the output. Trailing U+FFFD is held back: the last
  token ended inside a multi-byte UTF-8 character.
- `StopMatcher` finds stop strings across chunk boundaries and holds back the longest
  suffix that could still become one, so streamed text never has to be taken back.

`Detokenizer.push(ids)` returns text that is safe to send; `finish()` flushes the rest
when the scheduler ends the request. After a stop string, `stopped` is True and the text
is cut right before it (the stop string itself is not part of the output).
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.tokenizer import Decoder

REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 5  # emitted ids kept as left context (leading-space rules of some decoders)
# Output ending in U+FFFD is held back (the last token ended inside a character). After
# this many unread tokens it is released anyway: those bytes are invalid, not incomplete.
MAX_PENDING = 16


class IncrementalDecoder:
    """Token ids -> text deltas, never splitting a UTF-8 character.

    The window is a few already-emitted ids (context, whose text is cached) plus the
    unread ids. Each push decodes the window once; the text past the context, minus any
    trailing U+FFFD, is what may be emitted. When the window text is complete the unread
    ids become the new context, so the window (and the cost per push) stays small."""

    def __init__(self, decoder: Decoder, skip_special_tokens: bool = True, context: Sequence[int] = ()) -> None:
        self._decoder = decoder
        self._skip = skip_special_tokens
        self._ids = list(context[-CONTEXT_TOKENS:]) if CONTEXT_TOKENS else []
        self._read = len(self._ids)  # ids before this are context
        self._context_text = self._decode(self._ids)
        self._sent = 0  # characters of the text past the context already emitted

    def _decode(self, ids: list[int]) -> str:
        return self._decoder.decode(ids, skip_special_tokens=self._skip) if ids else ""

    def push(self, new_ids: Sequence[int]) -> str:
        """Add ids; return the text they complete (maybe "", maybe more than their own)."""
        if not new_ids:
            return ""
        self._ids.extend(new_ids)
        text = self._decode(self._ids)[len(self._context_text) :]
        if text.endswith(REPLACEMENT) and len(self._ids) - self._read <= MAX_PENDING:
            safe = text.rstrip(REPLACEMENT)
            delta = safe[self._sent :]
            self._sent = max(self._sent, len(safe))
            return delta
        return self._advance(text)

    def flush(self) -> str:
        """Everything not yet emitted, incomplete characters included (as U+FFFD)."""
        if self._read == len(self._ids):
            return ""
        return self._advance(self._decode(self._ids)[len(self._context_text) :])

    def _advance(self, text: str) -> str:
        delta = text[self._sent :]
        del self._ids[: max(0, len(self._ids) - CONTEXT_TOKENS)]
        self._read = len(self._ids)
        self._context_text = self._decode(self._ids)
        self._sent = 0
        return delta


class StopMatcher:
    """Finds the earliest stop string in a text stream; releases text that cannot start one."""

    def __init__(self, stops: Sequence[str], keep: bool = False) -> None:
        self._stops = [s for s in stops if s]
        self._keep = keep  # the output keeps the stop string that ended it
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the output

    def feed(self, text: str) -> str:
        """Add text; return what is safe to emit. After a hit, returns the text before the
        stop string and ignores further input."""
        if self.stopped or not self._stops:
            return "" if self.stopped else text
        buf = self._held + text
        hits = [(i, -len(s)) for s in self._stops if (i := buf.find(s)) >= 0]
        if hits:  # the earliest; of those starting there, the longest
            hit, neg_len = min(hits)
            self.stopped, self._held = True, ""
            self.matched = buf[hit : hit - neg_len]
            return buf[: hit - neg_len] if self._keep else buf[:hit]
        keep = self._partial_len(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """Release held text: the output ended without completing a stop string."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _partial_len(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string: the
        suffixes tried start where the stop's first character is (leftmost first: the longest)."""
        best, n = 0, len(buf)
        for stop in self._stops:
            j = buf.find(stop[0], max(0, n - len(stop) + 1))
            while 0 <= j and n - j > best:
                if stop.startswith(buf[j:]):
                    best = n - j
                    break
                j = buf.find(stop[0], j + 1)
        return best


class Detokenizer:
    """Per-request output text: UTF-8 safe, special tokens skipped on request, stop strings cut.

    The text of the first `min_tokens` tokens (min_new_tokens) is never searched for a stop
    string: a stop counts only in text decoded after them."""

    def __init__(
        self,
        decoder: Decoder | None,
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        prompt_ids: Sequence[int] = (),
        min_tokens: int = 0,
        keep_stop: bool = False,
    ) -> None:
        # decoder None: ids-only mode, the output text is always empty.
        self._dec = IncrementalDecoder(decoder, skip_special_tokens, prompt_ids) if decoder else None
        self._stop = StopMatcher(stop, keep_stop)
        self._unsearched = min_tokens  # tokens left whose text bypasses the stop matcher
        self._parts: list[str] = []  # everything emitted so far (a list: `+=` on a str is quadratic)

    @property
    def stopped(self) -> bool:
        return self._stop.stopped

    @property
    def matched(self) -> str | None:
        """The stop string that ended the output (None: none did)."""
        return self._stop.matched

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._parts)

    def push(self, new_ids: Sequence[int]) -> str:
        if self._dec is None or self.stopped:
            return ""
        k = min(self._unsearched, len(new_ids))
        self._unsearched -= k
        text = self._dec.push(new_ids[:k]) if k else ""
        if k < len(new_ids):
            text += self._stop.feed(self._dec.push(new_ids[k:]))
        return self._emit(text)

    def finish(self) -> str:
        """The remaining text once the request has ended (call once, after the last push)."""
        if self._dec is None or self.stopped:
            return ""
        out = self._stop.feed(self._dec.flush())
        if not self.stopped:
            out += self._stop.flush()
        return self._emit(out)

    def _emit(self, text: str) -> str:
        if text:
            self._parts.append(text)
        return text
