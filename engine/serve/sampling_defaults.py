"""The model's recommended sampling parameters (`--sampling-defaults model`, the default).

Model makers put them in generation_config.json (Qwen3: temperature 0.6, top_p 0.95, top_k 20).
SGLang (`--sampling-defaults model`) and vLLM (`--generation-config auto`) apply them to every
request that leaves them unset, and so do we: the OpenAI routes and /generate (a field absent or
null) and the SDK (`GenerateRequest.unset`, filled by the client from what its caller left out or
gave as None). `do_sample` is not read, as neither reads it. Read once at start; a value the
engine would refuse fails the start, naming the file and the field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

from msgs.params import MODEL_DEFAULT_FIELDS, SamplingParams


def model_sampling_defaults(model_dir: str) -> dict[str, Any]:
    """Those of MODEL_DEFAULT_FIELDS that `model_dir/generation_config.json` sets ({} without
    one). HF's top_k 0 (off) is our -1. ValueError on a file or value the engine cannot take."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        gen = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot read it ({exc})") from None
    if not isinstance(gen, dict):
        raise ValueError(f"{path}: not a JSON object")
    found = {name: gen[name] for name in MODEL_DEFAULT_FIELDS if gen.get(name) is not None}
    if found.get("top_k") == 0:
        found["top_k"] = -1
    try:
        problem = msgspec.convert(found, SamplingParams).validate()
    except msgspec.ValidationError as exc:
        problem = str(exc)
    if problem:
        raise ValueError(f"{path}: its sampling defaults are not usable: {problem}")
    return found

