"""Synthetic workloads: random token-id prompts with seeded lengths, and the model they target."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class BenchRequest:
    prompt: list[int]
    output_len: int


def resolve_model_dir(model: str | None) -> Path:
    """The model directory a run uses: --model (a directory, or a hub id resolved as bin/serve
    resolves it: engine/hub.py), or the default model (prepared on first use)."""
    if model:
        from engine.hub import resolve_model

        return Path(resolve_model(model, "dummy"))  # the config is all a workload reads
    from models.default_model import ensure_default_model

    return ensure_default_model()


def model_name(model: str | None) -> str:
    """Short name for result files: the model directory's name."""
    return Path(model).name if model else DEFAULT_MODEL_NAME


def served_model_name(url: str) -> str | None:
    """The model a running server names in GET /v1/models (None if it does not answer)."""
    import httpx

    try:
        data = httpx.get(f"{url.rstrip('/')}/v1/models", timeout=10).json()["data"]
        return str(data[0]["id"])
    except (httpx.HTTPError, KeyError, IndexError, ValueError):
        return None


def vocab_size(model_dir: Path) -> int:
    """vocab_size from the model's config.json."""
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


def lengths(rng: np.random.Generator, n: int, fixed: int | None, span: tuple[int, int]) -> list[int]:
    """n lengths: all `fixed`, or uniform integers in [lo, hi] (both inclusive)."""
    if fixed is not None:
        return [fixed] * n
    lo, hi = span
    return rng.integers(lo, hi + 1, size=n).tolist()


def random_requests(
    num: int,
    input_span: tuple[int, int],
    output_span: tuple[int, int],
    vocab: int,
    seed: int,
    input_len: int | None = None,
    output_len: int | None = None,
) -> list[BenchRequest]:
    """`num` requests of random token ids (uniform over the vocabulary), reproducible from `seed`.

    Every prompt is drawn independently, so prompts share no prefix (no radix cache hits)."""
    rng = np.random.default_rng(seed)
    ins = lengths(rng, num, input_len, input_span)
    outs = lengths(rng, num, output_len, output_span)
    return [BenchRequest(rng.integers(0, vocab, size=i).tolist(), o) for i, o in zip(ins, outs, strict=True)]


def token_totals(reqs: list[BenchRequest]) -> tuple[int, int]:
    """(total prompt tokens, total requested output tokens)."""
    return sum(len(r.prompt) for r in reqs), sum(r.output_len for r in reqs)


def cut_model(model: str, layers: int, into: Path) -> str:
    """A copy of the model directory's config with only its first `layers` layers (other files linked)."""
    src = Path(model)
    into.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "config.json":
            (into / f.name).symlink_to(f.resolve())
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_hidden_layers"] = layers
    (into / "config.json").write_text(json.dumps(cfg))
    return str(into)
