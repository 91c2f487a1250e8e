"""bin/serve flags: every one explained, with its default."""

from __future__ import annotations

import dataclasses

from engine.args import HELP, HIDDEN, build_parser
from engine.config import ServerConfig


def test_every_flag_has_help_and_shows_its_default() -> None:
    parser = build_parser()
    text = parser.format_help()
    fields = [f for f in dataclasses.fields(ServerConfig) if f.name not in HIDDEN]
    assert set(HELP) == {f.name for f in fields}
    for action in parser._actions:
        if action.dest == "help":
            continue
        assert action.help and len(action.help) > 10, action.dest
        assert parser.formatter_class(prog="x")._get_help_string(action).endswith(")"), action.dest
    for f in fields:
        assert "--" + f.name.replace("_", "-") in text
    assert "(default: 127.0.0.1)" in text and "(default: 0.85)" in text and "(default: False)" in text


def test_flags_build_the_config() -> None:
    from engine.args import parse_args

    cfg = parse_args(["--cpu-threads", "2", "--disable-overlap", "--page-size", "32"])
    assert cfg.cpu_threads == 2 and cfg.disable_overlap and cfg.page_size == 32
