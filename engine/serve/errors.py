"""API errors: one exception type carried from validation to the HTTP and SDK fronts.

Every problem a client can cause is an `ApiError` with a 4xx status; the fronts turn it
into an OpenAI-style body (`error_body`) or an SDK `GenerateError`. Anything else that
escapes a handler is a bug: it is logged and answered with a 500 in the same format.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

MAX_MESSAGE = 1000  # characters of an error message: one quoting a 5 MB field answered (and logged) 5 MB
_PATH = re.compile(r"at `\$\.([^`]*)`")
_UNKNOWN = re.compile(r"unknown field `([^`]*)`")
_MISSING = re.compile(r"missing required field `([^`]*)`")
_KEY_IN = re.compile(r"at `key` in `\$\.([^`]*)`")  # a dict's key of the wrong type (logit_bias)


class ApiError(Exception):
    """A request that cannot be served, with the HTTP status to answer it with."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        if len(message) > MAX_MESSAGE:  # a message quoting the client's input is not its input back, in full
            message = f"{message[:MAX_MESSAGE]}... ({len(message)} characters)"
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape. 4xx are the client's fault, everything else is ours."""
    kind = "invalid_request_error" if 400 <= status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def api_error_body(err: ApiError) -> dict[str, Any]:
    return error_body(err.status, err.message, err.param, err.code)


def from_validation(exc: msgspec.DecodeError | msgspec.ValidationError, prefix: str = "") -> ApiError:
    """Turn a msgspec decode/validation failure into a 400 naming the offending field."""
    text = str(exc)
    if isinstance(exc, msgspec.ValidationError):
        param = _field(text)
        if param is not None and prefix:
            param = f"{prefix}.{param}"
            text = text.replace("at `$.", f"at `$.{prefix}.").replace("in `$.", f"in `$.{prefix}.")
        return ApiError(400, f"invalid request body: {text}", param=param)
    return ApiError(400, f"invalid JSON: {text}")


def _field(text: str) -> str | None:
    for pattern in (_PATH, _UNKNOWN, _MISSING, _KEY_IN):
        found = pattern.search(text)
        if found:
            return found.group(1)
    return None
