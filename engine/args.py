"""Command-line flags -> ServerConfig (the only place flags are defined)."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from engine.config import ServerConfig

_HELP = {
    "model": "HF-style model directory (default: SmolLM2-135M-Instruct, prepared on first run)",
    "load_format": "auto | safetensors | dummy (random weights from config.json)",
    "port": "HTTP port",
    "sdk_port": "ZMQ port for the client SDK",
    "log_dir": "write one JSON log file per process here",
    "max_total_tokens": "cap the KV pool at this many tokens (0: size from free memory)",
    "max_prefill_tokens": "token budget per step; longer prompts are prefilled in chunks",
    "attention_backend": "auto | torch | flashinfer",
    "context_length": "max prompt + output tokens (0: the model's own)",
    "kv_cache_dtype": "auto (the model dtype) | fp8_e4m3: KV stored in 8-bit floats, half the bytes",
    "attention_fp8_math": "with an fp8 KV cache on SM90, decode attention in fp8 tensor-core math (queries and "
    "probabilities rounded to e4m3, as FA3/TensorRT-LLM fp8 attention do): ~2x faster decode attention, less precise",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bin/serve", description="Strata LLM server")
    for f in dataclasses.fields(ServerConfig):
        if f.name in ("run_dir", "extra"):
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        if isinstance(default, bool):
            parser.add_argument(flag, action="store_true", help=_HELP.get(f.name))
        else:
            parser.add_argument(flag, type=type(default), default=default, help=_HELP.get(f.name))
    return parser


def parse_args(argv: list[str] | None = None) -> ServerConfig:
    ns = build_parser().parse_args(argv)
    try:
        return ServerConfig(**vars(ns))
    except ValueError as exc:
        print(f"strata: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc
