"""Structured JSON logs: an exception is one event with its traceback as data."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import logging, sys
from engine.logs import setup_logging
log = setup_logging("probe", sys.argv[1], rank=3)
def fail():
    raise ValueError("bad value 42")
try:
    fail()
except ValueError:
    log.exception("step failed", seq=7)
try:
    {}["missing"]
except KeyError:
    logging.getLogger("strata.msgs").exception("stdlib failure")
"""


def test_exception_is_logged_with_structured_traceback(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=ROOT, check=True, capture_output=True)
    lines = (tmp_path / "probe-3.log").read_text().splitlines()
    assert len(lines) == 2  # one event per exception, no stray traceback lines
    first, second = (json.loads(line) for line in lines)
    assert first["event"] == "step failed" and first["seq"] == 7 and first["proc"] == "probe" and first["rank"] == 3
    (exc,) = first["exception"]
    assert exc["exc_type"] == "ValueError" and exc["exc_value"] == "bad value 42"
    assert [f["name"] for f in exc["frames"]][-1] == "fail"
    assert "locals" not in exc["frames"][0]  # prompts and tensors stay out of the log
    assert second["exception"][0]["exc_type"] == "KeyError"
    assert "exc_info" not in first and "exc_info" not in second
