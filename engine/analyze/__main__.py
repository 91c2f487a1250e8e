"""`python -m engine.analyze` (bin/analyze)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engine.analyze import __doc__ as DOC
from engine.analyze.render import plot, print_text, to_json
from engine.analyze.report import analyze

# ---------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bin/analyze", description=(DOC or "").split("\n\n")[0])
    p.add_argument("logdir", type=Path, help="the --log-dir of a bin/serve run")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--plot", type=Path, metavar="OUT_DIR", help="write PNG charts here")
    p.add_argument("--no-timelines", action="store_true", help="omit the per-request table")
    args = p.parse_args(argv)
    if not args.logdir.is_dir():
        p.error(f"{args.logdir} is not a directory")
    if not any(args.logdir.glob("*.log")):  # (a summary of nothing read as "no requests, no errors")
        p.error(f"{args.logdir} holds no *.log files: give the --log-dir of a bin/serve run")
    if args.plot is not None and args.plot.exists() and not args.plot.is_dir():
        p.error(f"--plot {args.plot}: a file, not a directory")
    rep = analyze(args.logdir)
    if args.json:
        print(to_json(rep))
    else:
        print_text(rep, timelines=not args.no_timelines)
    if args.plot is not None:
        try:
            written = plot(rep, args.plot)
        except ImportError as e:  # matplotlib is a dependency; a broken install gets one line
            print(f"bin/analyze: --plot needs matplotlib ({e})", file=sys.stderr)
            return 1
        except OSError as e:
            print(f"bin/analyze: --plot {args.plot}: {e.strerror or e}", file=sys.stderr)
            return 1
        for path in written:
            print(f"wrote {path}", file=sys.stderr if args.json else sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
