"""The tokenizer process: HTTP (OpenAI API) and ZMQ SDK front door.

    python -m procs.tokenizer --config PATH_TO_CONFIG_JSON

A thin shell: parse arguments, set up logging, run engine.serve.server on uvloop.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import uvloop

from engine.config import ServerConfig
from engine.logs import setup_logging
from engine.serve.server import run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True, help="ServerConfig as a JSON file")
    args = parser.parse_args(argv)
    try:
        cfg = ServerConfig.from_json(Path(args.config).read_text())
    except (OSError, ValueError) as exc:  # no run_dir known yet: stderr is all we have
        print(f"tokenizer: bad --config {args.config}: {exc}", file=sys.stderr)
        return 2
    setup_logging("tokenizer", cfg.log_dir)
    if not cfg.model:
        # The supervisor normally resolves the default model; this keeps a hand-started
        # tokenizer working too (a no-op lookup once the conversion is cached).
        from models.default_model import ensure_default_model

        cfg = dataclasses.replace(cfg, model=str(ensure_default_model()))
    return uvloop.run(run(cfg))


if __name__ == "__main__":
    sys.exit(main())
