"""How far are bf16 logits from fp32's on the CPU path? (diagnostic, not in CI)

    .venv/bin/python scripts/cpu_bf16_logits.py [--text] [--old-decode]

Teacher-forced, so one early flip does not decide the rest: the default model in float32
prefills the prompts and decodes greedily; the bfloat16 model is fed the same tokens (the
float32 model's) step by step. Per decode step and row: whether bf16's argmax is the fp32
token, KL(fp32 || bf16) and the largest logit difference. --old-decode runs bf16 decode
attention the previous way (KV converted to fp32, two fp32 GEMMs) for an A/B of attention's
rounding alone.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from engine.config import ServerConfig  # noqa: E402
from engine.layers import attention  # noqa: E402
from engine.layers.forward import ForwardBatch  # noqa: E402
from engine.run.runner import ModelRunner  # noqa: E402
from models.default_model import ensure_default_model  # noqa: E402


def _runner(dtype: str, tokens: int, batch: int) -> ModelRunner:
    return ModelRunner(ServerConfig(model=str(ensure_default_model()), device="cpu", dtype=dtype,
                                    max_running_requests=batch, max_total_tokens=tokens, max_prefill_tokens=tokens))


def _forward(r: ModelRunner, reqs: list[tuple[list[int], int, list[int]]]) -> torch.Tensor:
    batch = ForwardBatch.from_requests(reqs, r.page_size, "cpu")
    r.backend.prepare(batch)
    return r.model(batch, r.kv, r.backend).float()


def _old_decode(self, q, layer_id, batch, kv_pool):  # noqa: ANN001, ANN202
    """TorchAttention.attend as it was for a decode-only half-precision step (fp32 GEMMs)."""
    g = self._decode
    kg, vg = kv_pool.gather_pages(layer_id, g.pages, torch.float32)
    return attention._decode_attention(q[g.rows], kg, vg, g.mask).to(q.dtype)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--text", action="store_true", help="the chat prompts of cpu_dtype_agreement.py")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--old-decode", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(2)
    if a.text:
        from cpu_dtype_agreement import TEXT  # scripts/ is sys.path[0]
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(str(ensure_default_model() / "tokenizer.json"))
        prompts = [tok.encode(f"<|im_start|>user\n{t}<|im_end|>\n<|im_start|>assistant\n").ids for t in TEXT]
    else:
        gen = torch.Generator().manual_seed(0)
        prompts = torch.randint(0, 49152, (a.batch, a.input_len), generator=gen).tolist()
    per = -(-(max(map(len, prompts)) + a.output_len) // 16)
    pages = [list(range(1 + i * per, 1 + (i + 1) * per)) for i in range(len(prompts))]
    tokens = (len(prompts) * per + 2) * 16
    r32, r16 = _runner("float32", tokens, len(prompts)), _runner("bfloat16", tokens, len(prompts))
    if a.old_decode:
        plain = attention.TorchAttention.attend
        attention.TorchAttention.attend = lambda s, q, li, b, kv: (  # type: ignore[method-assign]
            _old_decode(s, q, li, b, kv) if s._all_decode else plain(s, q, li, b, kv))
    l32 = _forward(r32, [(x, 0, pg) for x, pg in zip(prompts, pages, strict=True)])
    l16 = _forward(r16, [(x, 0, pg) for x, pg in zip(prompts, pages, strict=True)])
    agree, kls, diffs = [], [], []
    for step in range(a.output_len):
        toks = l32.argmax(-1)
        agree.append((l16.argmax(-1) == toks).float().mean().item())
        lp32, lp16 = l32.log_softmax(-1), l16.log_softmax(-1)
        kls.append((lp32.exp() * (lp32 - lp16)).sum(-1).mean().item())
        diffs.append((l32 - l16).abs().max().item())
        if step + 1 == a.output_len:
            break
        reqs = [([int(t)], len(x) + step, pg) for t, x, pg in zip(toks, prompts, pages, strict=True)]
        l32, l16 = _forward(r32, reqs), _forward(r16, reqs)
    n = len(agree)
    print(f"bf16 vs fp32, teacher-forced, {len(prompts)} rows x {n} steps{' (old decode)' if a.old_decode else ''}: "
          f"argmax equal {100 * sum(agree) / n:.1f}%, mean KL {sum(kls) / n:.5f}, max |logit diff| {max(diffs):.3f}")


if __name__ == "__main__":
    main()
