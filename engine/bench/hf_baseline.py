"""The transformers baseline of `bin/bench cpu`, run in a child process of the benchmark.

`python -m engine.bench.hf_baseline MODEL_DIR DTYPE` loads the model, warms it up, writes one
JSON line `{"threads": N}` to stdout, then answers JSON-line commands from stdin, one line of
output each, until stdin ends:
- `{"op": "generate", "prompts": [[ids]], "output_len": N}`: greedy `generate` of the batch (no
  EOS stop, so every row yields exactly its tokens): `{"seconds": s, "ids": [[new ids]]}`;
- `{"op": "forward", "prompt": [ids]}`: one forward pass: `{"seconds": s, "next_id": id}`.
It stays loaded between commands, so that the benchmark can alternate rounds of both sides
(a shared machine drifts by tens of percent over a minute). A child process: its torch
threads and OpenMP settings are transformers' defaults, what a user of transformers gets;
progress bars go to stderr.
"""

from __future__ import annotations

import json
import sys
import time
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


def serve(model_dir: str, dtype: str) -> None:
    model = load(model_dir, dtype)
    generate(model, [[1] * 8, [2] * 8], 2)  # warm-up: first-call allocations and kernel selection
    print(json.dumps({"threads": torch.get_num_threads()}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "generate":
            seconds, ids = generate(model, cmd["prompts"], cmd["output_len"])
            out: dict[str, Any] = {"seconds": seconds, "ids": ids}
        else:
            seconds, next_id = forward(model, cmd["prompt"])
            out = {"seconds": seconds, "next_id": next_id}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2])
