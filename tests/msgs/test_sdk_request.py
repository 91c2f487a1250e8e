"""The SDK client types a request before sending it (msgs/sdk.py `_request`): a prompt that is
neither a string nor a list of token ids is its StrataError 400 at once (an audit: None and 5
were a TypeError, a huge int an OverflowError at encoding, and bytes passed as token ids)."""

from __future__ import annotations

import pytest

from msgs.sdk import GenerateRequest, StrataError, _request


@pytest.mark.parametrize("prompt", [None, 5, b"abc", [1, "2"], [1.0], [True], [-(2**70)], {1, 2}])
def test_a_prompt_that_is_not_text_or_token_ids_is_a_400(prompt: object) -> None:
    with pytest.raises(StrataError) as err:
        _request(prompt, False, None, {}, "")  # type: ignore[arg-type]
    assert err.value.status == 400 and "prompt" in str(err.value)


def test_text_and_token_ids_are_requests() -> None:
    assert _request("hi", False, "r", {}, "").text == "hi"
    req = _request((5, 6), True, "r", {"max_new_tokens": 2}, "")
    assert isinstance(req, GenerateRequest) and req.input_ids == [5, 6] and req.params.max_new_tokens == 2
