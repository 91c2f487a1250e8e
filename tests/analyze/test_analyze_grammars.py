"""bin/analyze reports new grammars: the tokenizer's `grammar compiled` checks and the scheduler's
`grammar ready` lines (engine/sched/grammars.py: every rank compiled a PrepareGrammar)."""

from __future__ import annotations

import io
import json
from pathlib import Path

from engine.analyze import analyze, print_text


def _line(proc: str, event: str, at: str, **fields: object) -> str:
    return json.dumps({"event": event, **fields, "proc": proc, "level": "info", "timestamp": at})


def test_checks_compiles_and_recompiles(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.log").write_text("\n".join([
        _line("tokenizer", "grammar compiled", "2026-01-01T00:00:00.000000Z", key="a", seconds=0.02),
        _line("tokenizer", "grammar compiled", "2026-01-01T00:00:00.100000Z", key="b", seconds=1.5),
    ]) + "\n")
    (tmp_path / "scheduler.log").write_text("\n".join([
        _line("scheduler", "grammar ready", "2026-01-01T00:00:01.000000Z", key="a", ready_ms=30.0, steps_meanwhile=2,
              requests=1),
        _line("scheduler", "grammar ready", "2026-01-01T00:00:03.000000Z", key="b", ready_ms=1800.0,
              steps_meanwhile=300, requests=4),
        _line("scheduler", "grammar ready", "2026-01-01T00:00:09.000000Z", key="a", ready_ms=40.0, steps_meanwhile=5,
              requests=1),
    ]) + "\n")
    rep = analyze(tmp_path)
    g = rep.grammars
    assert (g["checked"], g["ready"], g["distinct_keys"], g["steps_meanwhile"]) == (2, 3, 2, 307)
    assert g["ready_ms"]["p50"] == 40.0 and g["check_ms"]["count"] == 2
    buf = io.StringIO()
    print_text(rep, out=buf)
    text = buf.getvalue()
    assert "grammars: 2 checked by the tokenizer" in text and "3 compiled on every rank (2 keys" in text
    assert "307 steps went out meanwhile" in text and "1 compiles of keys compiled before" in text


def test_no_grammar_no_section(tmp_path: Path) -> None:
    (tmp_path / "scheduler.log").write_text(_line("scheduler", "admitted", "2026-01-01T00:00:00.000000Z") + "\n")
    rep = analyze(tmp_path)
    buf = io.StringIO()
    print_text(rep, out=buf)
    assert rep.grammars == {} and "grammars:" not in buf.getvalue()
