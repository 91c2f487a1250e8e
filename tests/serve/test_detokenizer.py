"""Incremental detokenization: UTF-8 safety, special tokens, stop strings."""

from __future__ import annotations

import random

import pytest

from engine.serve.detokenizer import MAX_PENDING, REPLACEMENT, Detokenizer, IncrementalDecoder, StopMatcher

TEXT = "héllo 日本語 🎉 done. Ünïcödé: 𝔘𝔫𝔦 and more"


def _push_all(dec: IncrementalDecoder | Detokenizer, ids: list[int], sizes: list[int]) -> list[str]:
    out, i = [], 0
    for size in sizes:
        out.append(dec.push(ids[i : i + size]))
        i += size
    return out


def _sizes(n: int, rng: random.Random) -> list[int]:
    sizes = []
    while sum(sizes) < n:
        sizes.append(rng.randint(1, 4))
    return sizes


def test_multibyte_characters_split_over_tokens_are_never_emitted_partially(small_tok) -> None:
    ids = small_tok.encode(TEXT).ids
    assert len(ids) > len(TEXT.encode()) // 2  # many single-byte tokens: real splits
    dec = IncrementalDecoder(small_tok)
    deltas = _push_all(dec, ids, [1] * len(ids))
    assert "".join(deltas) + dec.flush() == TEXT
    assert all(REPLACEMENT not in d for d in deltas)
    assert "" in deltas  # some tokens end inside a character and emit nothing yet


@pytest.mark.parametrize("seed", range(5))
def test_any_chunking_gives_the_same_text(small_tok, seed: int) -> None:
    ids = small_tok.encode(TEXT).ids
    dec = IncrementalDecoder(small_tok)
    deltas = _push_all(dec, ids, _sizes(len(ids), random.Random(seed)))
    assert "".join(deltas) + dec.flush() == TEXT
    assert all(REPLACEMENT not in d for d in deltas)


def test_prompt_context_is_not_part_of_the_output(small_tok) -> None:
    prompt = small_tok.encode("hello world, the").ids
    out = small_tok.encode(" quick 日本").ids
    dec = IncrementalDecoder(small_tok, context=prompt)
    assert "".join(_push_all(dec, out, [1] * len(out))) + dec.flush() == " quick 日本"


def test_invalid_bytes_before_a_valid_character_are_kept(small_tok) -> None:
    lone = small_tok.encode("é").ids[1]  # a continuation byte on its own: never valid
    emoji = small_tok.encode("🎉").ids
    assert len(emoji) == 4
    ids = [lone] * 6 + emoji + small_tok.encode(" ok").ids
    dec = IncrementalDecoder(small_tok)
    deltas = _push_all(dec, ids, [1] * len(ids))
    text = "".join(deltas) + dec.flush()
    assert text == small_tok.decode(ids) == REPLACEMENT * 6 + "🎉 ok"
    assert not deltas[-1].startswith(REPLACEMENT)


def test_a_stream_of_invalid_bytes_does_not_stall(small_tok) -> None:
    lone = small_tok.encode("é").ids[1]
    dec = IncrementalDecoder(small_tok)
    deltas = _push_all(dec, [lone] * (MAX_PENDING + 2), [1] * (MAX_PENDING + 2))
    assert REPLACEMENT in "".join(deltas)  # released before the request ends
    assert "".join(deltas) + dec.flush() == REPLACEMENT * (MAX_PENDING + 2)


def test_flush_releases_an_incomplete_character(small_tok) -> None:
    ids = small_tok.encode("a🎉").ids
    dec = IncrementalDecoder(small_tok)
    assert dec.push(ids[:-1]) == "a"
    assert dec.flush() == REPLACEMENT


def test_skip_special_tokens(small_tok) -> None:
    ids = small_tok.encode("hello<|im_end|> world").ids
    assert small_tok.token_to_id("<|im_end|>") in ids
    skip = Detokenizer(small_tok, skip_special_tokens=True)
    keep = Detokenizer(small_tok, skip_special_tokens=False)
    assert "".join(_push_all(skip, ids, [1] * len(ids))) + skip.finish() == "hello world"
    assert "".join(_push_all(keep, ids, [1] * len(ids))) + keep.finish() == "hello<|im_end|> world"


# -- stop strings -----------------------------------------------------------------------


def test_stop_string_across_chunks_is_trimmed_and_never_streamed() -> None:
    m = StopMatcher(["STOP"])
    assert m.feed("Hel") == "Hel"
    assert m.feed("lo ST") == "lo "  # "ST" may start the stop string: held back
    assert not m.stopped
    assert m.feed("OP and the rest") == ""
    assert m.stopped
    assert m.feed("more") == "" and m.flush() == ""


def test_held_back_text_is_released_when_the_match_fails() -> None:
    m = StopMatcher(["STOP"])
    assert m.feed("a S") == "a "
    assert m.feed("T") == ""
    assert m.feed("x") == "STx"
    assert m.feed("ST") == ""
    assert m.flush() == "ST"


def test_earliest_stop_string_wins() -> None:
    m = StopMatcher(["world", "lo w"])
    assert m.feed("hello world") == "hel"
    assert m.stopped


def test_include_stop_str_in_output_keeps_the_stop_that_ended_it() -> None:
    """vLLM's include_stop_str_in_output: the earliest stop, and of two starting there the longer."""
    m = StopMatcher(["world"], keep=True)
    assert m.feed("hello wor") == "hello "  # "wor" may start the stop string: held back
    assert m.feed("ld and more") == "world" and m.stopped
    assert StopMatcher(["world", "lo w"], keep=True).feed("hello world") == "hello w"  # the earliest
    m = StopMatcher(["ab", "abc"], keep=True)
    assert m.feed("xabcd") == "xabc"
    assert StopMatcher(["ab", "abc"]).feed("xabcd") == "x"  # trimmed, whichever matched


def test_no_stop_strings_passes_everything() -> None:
    m = StopMatcher([])
    assert m.feed("abc") == "abc" and m.flush() == ""


def _run(small_tok, text: str, stop: list[str], sizes: list[int] | None) -> tuple[list[str], str, bool]:
    ids = small_tok.encode(text).ids
    det = Detokenizer(small_tok, stop=stop)
    deltas = _push_all(det, ids, sizes or [len(ids)])
    if not det.stopped:
        deltas.append(det.finish())
    return deltas, det.text, det.stopped


@pytest.mark.parametrize("stop", [["本語"], ["語 e"], ["nope", " 日"]])
def test_stop_strings_streaming_and_whole_agree(small_tok, stop: list[str]) -> None:
    text = "abc 日本語 end of text"
    expected = text[: min(i for i in (text.find(s) for s in stop) if i >= 0)]
    ids = small_tok.encode(text).ids
    streamed, full, stopped = _run(small_tok, text, stop, [1] * len(ids))
    assert stopped and full == expected and "".join(streamed) == expected
    whole, full2, stopped2 = _run(small_tok, text, stop, None)
    assert stopped2 and full2 == expected and "".join(whole) == expected
    for delta in streamed:  # no streamed piece ever contains part of the stop string's match
        assert REPLACEMENT not in delta


def test_partial_stop_at_the_end_is_released_by_finish(small_tok) -> None:
    deltas, full, stopped = _run(small_tok, "count to ST", ["STOP"], [1] * 20)
    assert not stopped and full == "count to ST"
    assert deltas[-1].endswith("ST")  # held until finish


@pytest.mark.parametrize("sizes", [None, "ones"])
def test_stop_strings_are_not_searched_in_the_first_min_tokens(small_tok, sizes) -> None:
    """min_new_tokens: "b" in the first tokens' text does not stop; the next one after does,
    whether the tokens come one by one or in a single push that straddles the line."""
    text = "a b c b d"
    ids = small_tok.encode(text).ids
    first_b = next(i for i in range(1, len(ids) + 1) if "b" in small_tok.decode(ids[:i]))
    det = Detokenizer(small_tok, stop=["b"], min_tokens=first_b)
    deltas = _push_all(det, ids, [1] * len(ids) if sizes else [len(ids)])
    assert det.stopped and det.text == "a b c " and "".join(deltas) == det.text
    plain = Detokenizer(small_tok, stop=["b"])
    plain.push(ids)
    assert plain.text == "a "


def test_ids_only_detokenizer_emits_nothing() -> None:
    det = Detokenizer(None, stop=[])
    assert det.push([1, 2, 3]) == "" and det.finish() == "" and det.text == ""


def test_real_default_model_tokenizer_utf8(default_model_dir) -> None:
    """The default SmolLM2 tokenizer splits CJK and emoji into byte tokens too."""
    from engine.tokenizer import load_tokenizer

    tok = load_tokenizer(str(default_model_dir))
    assert tok is not None
    ids = tok.encode(TEXT, add_special_tokens=False)
    det = Detokenizer(tok, stop=["done"])
    deltas = [det.push([t]) for t in ids]
    assert det.stopped
    assert "".join(deltas) == TEXT[: TEXT.find("done")]
    assert all(REPLACEMENT not in d for d in deltas)


def test_held_back_text_is_the_longest_suffix_that_may_start_a_stop() -> None:
    """StopMatcher holds back exactly the longest suffix of its text that is a proper prefix of a
    stop string (brute force over random stops and texts of a 3-letter alphabet)."""
    rng = random.Random(0)
    for _ in range(3000):
        stops = ["".join(rng.choice("ab ") for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 3))]
        buf = "".join(rng.choice("ab ") for _ in range(rng.randint(0, 8)))
        want = max((k for s in stops for k in range(min(len(s) - 1, len(buf)) + 1) if buf.endswith(s[:k])), default=0)
        assert StopMatcher(stops)._partial_len(buf) == want, (stops, buf)
