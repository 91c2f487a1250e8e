"""The SDK client types a request before sending it (msgs/sdk.py `_request`): a prompt that is
neither a string nor a list of token ids is its StrataError 400 at once (an audit: None and 5
were a TypeError, a huge int an OverflowError at encoding, and bytes passed as token ids)."""

from __future__ import annotations

import asyncio

import pytest

from msgs.sdk import AsyncClient, Client, GenerateRequest, StrataError, _request


@pytest.mark.parametrize("prompt", [None, 5, b"abc", [1, "2"], [1.0], [True], [-(2**70)], {1, 2}])
def test_a_prompt_that_is_not_text_or_token_ids_is_a_400(prompt: object) -> None:
    with pytest.raises(StrataError) as err:
        _request(prompt, False, None, {}, "")  # type: ignore[arg-type]
    assert err.value.status == 400 and "prompt" in str(err.value)


def test_text_and_token_ids_are_requests() -> None:
    assert _request("hi", False, "r", {}, "").text == "hi"
    req = _request((5, 6), True, "r", {"max_new_tokens": 2}, "")
    assert isinstance(req, GenerateRequest) and req.input_ids == [5, 6] and req.params.max_new_tokens == 2


def test_max_new_tokens_left_out_or_none_is_clipped_by_the_server_as_over_http() -> None:
    """An audit: the SDK always sent max_new_tokens as given, so a prompt near the context's end was
    a 400 where /generate clips the default (and None, up to the context's end) to the room left."""
    from msgs.params import INT32

    left_out, unbounded, given = (_request("hi", False, "r", kw, "") for kw in
                                  ({}, {"max_new_tokens": None}, {"max_new_tokens": 5}))
    assert (left_out.max_given, left_out.params.max_new_tokens) == (False, 128)
    assert (unbounded.max_given, unbounded.params.max_new_tokens) == (False, INT32 - 1)
    assert (given.max_given, given.params.max_new_tokens) == (True, 5)


def test_a_rid_or_value_the_frame_cannot_carry_is_a_400_before_sending() -> None:
    """An audit: rid=5 reached the server as a frame it dropped (the client heard nothing for 10 s: a
    503), and seed=2**70 raised a raw OverflowError."""
    from msgs.sdk import _frame

    with pytest.raises(StrataError, match="rid must be a string") as err:
        _request("hi", False, 5, {}, "")  # type: ignore[arg-type]
    assert err.value.status == 400
    with pytest.raises(StrataError, match="bad request") as err:
        _frame(_request("hi", False, "r", {"seed": 2**70}, ""))
    assert err.value.status == 400



def test_a_closed_client_says_so() -> None:
    """An audit: a request on a closed client raised zmq's ENOTSOCK ("Socket operation on non-socket")."""
    c = Client("tcp://127.0.0.1:9")
    c.close()
    with pytest.raises(StrataError, match="closed") as err:
        c.generate("Hi", max_new_tokens=2)
    assert err.value.status == 400
    with pytest.raises(StrataError, match="closed"):
        next(c.stream("Hi", max_new_tokens=2))
    c.abort("any")  # nothing to send it on: no error

    async def main() -> None:
        ac = AsyncClient("tcp://127.0.0.1:9")
        ac.close()
        with pytest.raises(StrataError, match="closed"):
            await ac.generate("Hi", max_new_tokens=2)
        await ac.abort("any")

    asyncio.run(main())


def test_an_api_key_of_none_is_no_key() -> None:
    """An audit: api_key=None made frames a keyed server cannot decode (and answers silently)."""
    c = Client("tcp://127.0.0.1:9", api_key=None)
    assert c._api_key == ""
    c.close()
    with pytest.raises(TypeError, match="api_key must be a string"):
        Client("tcp://127.0.0.1:9", api_key=5)  # type: ignore[arg-type]
