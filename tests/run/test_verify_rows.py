"""A chain verify row of k + 1 tokens equals k + 1 decode rows over the same page table (the
form in which verify steps replay the decode CUDA graphs, engine/run/spec.py: Speculator._replay):
every layer writes all rows' K/V before it attends, and a decode row attends up to its own
position, so each row sees exactly its causal prefix. The real default model, float32."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.config import ServerConfig
from engine.layers.forward import ForwardBatch
from engine.local import LocalEngine


def test_a_verify_row_equals_its_tokens_as_decode_rows(default_model_dir: Path) -> None:
    eng = LocalEngine(ServerConfig(model=str(default_model_dir), dtype="float32", max_total_tokens=512,
                                   max_running_requests=4))
    r = eng.runner
    ps = r.page_size
    table = [1, 2, 3, 4]
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 1000, (2 * ps + 3,), generator=g).tolist()
    chain = torch.randint(3, 1000, (4,), generator=g).tolist()  # the last token, then 3 drafts
    start = len(prompt)

    def run(batch: ForwardBatch) -> torch.Tensor:
        with torch.inference_mode():
            r.backend.prepare(batch)
            return r.model(batch, r.kv, r.backend)

    run(ForwardBatch.build(prompt, [0], [start], [table], [1], ps, r.device))
    verify = ForwardBatch.build(chain, [start], [4], [table], [1], ps, r.device)
    verify.logit_indices = torch.arange(4)
    want = run(verify)
    rows = ForwardBatch.build(chain, [start + j for j in range(4)], [1] * 4, [table] * 4, [1] * 4, ps, r.device)
    got = run(rows)
    assert got.shape == want.shape == (4, r.mcfg.vocab_size)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
