"""The transformers baseline of `bin/bench cpu`, run in a child process of the benchmark.

`python -m engine.bench.hf_baseline SPEC.json OUT.json`: SPEC holds the model directory, the
batch of prompts, the output length and the long prompt. It measures `generate` (greedy, no
EOS stop, so every row yields exactly its tokens) on the batch and one forward pass of the
long prompt, on the same weights the server loads, and writes the timings and generated ids.
A child process: its memory is returned before the server starts, and its torch threads and
OpenMP settings are transformers' defaults, what a user of transformers gets.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm


def load(model_dir: str, dtype: str = "float32") -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    model.generation_config.eos_token_id = None  # like ignore_eos: every row runs to max_new_tokens
    model.generation_config.pad_token_id = 0
    return model.eval()


def generate(model: Any, prompts: list[list[int]], output_len: int) -> tuple[float, list[list[int]]]:
    """Seconds for one greedy `generate` of the whole batch, and the new ids of each row.
    Prompts of unequal length are left-padded (the attention mask hides the padding)."""
    from transformers import StoppingCriteria

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    class Progress(StoppingCriteria):  # one tick per decoding step; never stops generation
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kw: Any) -> torch.Tensor:
            bar.update(1)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    with tqdm(total=output_len, desc="transformers generate", unit="step") as bar, torch.inference_mode():
        t0 = time.perf_counter()
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=output_len, do_sample=False,
            stopping_criteria=[Progress()],
        )
        seconds = time.perf_counter() - t0
    return seconds, out[:, width:].tolist()


def forward(model: Any, prompt: list[int]) -> tuple[float, int]:
    """Seconds for one forward pass over `prompt` (logits of its last token only), and the
    greedy next token."""
    layers = model.model.layers
    with tqdm(total=len(layers), desc=f"transformers forward {len(prompt)} tokens", unit="layer") as bar:

        def tick(*_: Any) -> None:  # a forward hook that returns a value would replace the output
            bar.update(1)

        hooks = [layer.register_forward_hook(tick) for layer in layers]
        try:
            with torch.inference_mode():
                t0 = time.perf_counter()
                logits = model(torch.tensor([prompt]), logits_to_keep=1).logits
                seconds = time.perf_counter() - t0
        finally:
            for h in hooks:
                h.remove()
    return seconds, int(logits[0, -1].argmax())


def run(spec: dict[str, Any]) -> dict[str, Any]:
    model = load(spec["model_dir"], spec.get("dtype", "float32"))
    short = [p[:8] for p in spec["prompts"][:2]]
    generate(model, short, 2)  # warm-up: first-call allocations and kernel selection
    seconds, ids = generate(model, spec["prompts"], spec["output_len"])
    result: dict[str, Any] = {"threads": torch.get_num_threads(), "generate_s": seconds, "generate_ids": ids}
    if spec.get("long_prompt"):
        result["forward_s"], result["forward_next_id"] = forward(model, spec["long_prompt"])
    return result


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    Path(argv[1]).write_text(json.dumps(run(spec)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
