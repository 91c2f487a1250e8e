"""Every bin/bench flag of every mode has a help line, and --help shows its default."""

from __future__ import annotations

import argparse

from engine.bench.cli import build_parser


def test_every_bench_flag_is_explained_with_its_default() -> None:
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(subparsers.choices) >= {"offline", "serve", "latency", "cpu"}
    for mode, sub in subparsers.choices.items():
        text = sub.format_help()
        for action in sub._actions:
            if action.dest == "help":
                continue
            assert action.help, f"bin/bench {mode} {action.option_strings}: no help"
        assert "(default:" in text, mode
