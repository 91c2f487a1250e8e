"""bin/analyze reports speculative decoding from the scheduler's `speculative decoding` lines
(engine/sched/loop.py: cumulative verify rows, drafts, accepted): totals and the accept length
between lines."""

from __future__ import annotations

import io
import json
from pathlib import Path

from engine.analyze import analyze, print_text


def _line(at: str, rows: int, drafted: int, accepted: int, hist: list[int], chained: int = 0, void: int = 0,
          empty: int = 0) -> str:
    return json.dumps({"event": "speculative decoding", "rows": rows, "drafted": drafted, "accepted": accepted,
                       "accept_length": round(1 + accepted / rows, 3), "accept_hist": hist, "chained": chained,
                       "void": void, "empty": empty, "proc": "scheduler", "level": "info", "timestamp": at})


def test_accept_length_totals_and_series(tmp_path: Path) -> None:
    (tmp_path / "scheduler.log").write_text("\n".join([
        _line("2026-01-01T00:00:00.000000Z", 10, 30, 20, [2, 3, 5]),
        _line("2026-01-01T00:00:01.000000Z", 20, 60, 25, [7, 6, 7], chained=9, void=2, empty=31),
    ]) + "\n")
    rep = analyze(tmp_path)
    assert rep.spec["rows"] == 20 and rep.spec["accept_length"] == 2.25
    assert [p["accept_length"] for p in rep.spec["series"]] == [3.0, 1.5]  # 20/10 then 5/10 accepted a row
    buf = io.StringIO()
    print_text(rep, out=buf)
    assert "speculative decoding: 20 verify rows, accept length 2.25 tokens a row, 25 of 60 drafts accepted" in \
        buf.getvalue()
    assert rep.spec["chained"] == 9
    assert "overlapped: 9 rows chained on a row in flight, 2 of them void" in buf.getvalue()
    assert rep.spec["empty"] == 31 and "31 more rows found nothing to draft" in buf.getvalue()
