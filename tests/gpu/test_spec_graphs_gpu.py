"""Verify steps replay the decode CUDA graphs (engine/run/spec.py: Speculator._replay): a chain's
k + 1 tokens as k + 1 decode rows. On the H200, bf16, flashinfer: the replayed rows' logits are
the eager prefill-shaped verify's (to bf16 rounding), and a served NGRAM engine verifies in the
graphs, answers every request in full and leaves no page behind."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import ServerConfig
from engine.layers.forward import ForwardBatch
from engine.local import LocalEngine
from msgs.params import SamplingParams

pytestmark = pytest.mark.gpu


def _engine(model: Path, **kw) -> LocalEngine:  # noqa: ANN003
    return LocalEngine(ServerConfig(model=str(model), load_format="dummy", dtype="bfloat16", max_total_tokens=4096,
                                    max_running_requests=8, **kw))


def test_replayed_verify_rows_equal_the_eager_verify(dummy_models: dict[str, Path], flashinfer_built: None) -> None:
    eng = _engine(dummy_models["llama-h128"], speculative_algorithm="NGRAM")
    r = eng.runner
    assert r.graphs is not None and r.graphs.max_batch == 8 * 4  # rows for every request's k + 1 tokens
    ps, table = r.page_size, [1, 2, 3, 4, 5]
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 2000, (3 * ps + 5,), generator=g).tolist()
    chain = torch.randint(3, 2000, (4,), generator=g).tolist()
    start = len(prompt)
    with torch.inference_mode():
        pre = ForwardBatch.build(prompt, [0], [start], [table], [1], ps, r.device)
        r.backend.prepare(pre)
        r.model(pre, r.kv, r.backend)
        verify = ForwardBatch.build(chain, [start], [4], [table], [1], ps, r.device)
        verify.logit_indices = torch.arange(4, device=r.device)
        r.backend.prepare(verify)
        want = r.model(verify, r.kv, r.backend).float().clone()
        got = r.graphs.run_decode(chain, [0] * 4, [start + j for j in range(4)], [table] * 4, r.last_token)
        got = got.float().clone()
    torch.cuda.synchronize()
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() <= 0.03 * scale
    top2 = want.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.05 * scale  # rows whose argmax no rounding can flip
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


def test_served_ngram_verifies_in_the_graphs(dummy_models: dict[str, Path], flashinfer_built: None) -> None:
    eng = _engine(dummy_models["llama-h128"], speculative_algorithm="NGRAM", speculative_num_steps=3)
    g = torch.Generator().manual_seed(1)
    motif = torch.randint(3, 2000, (24,), generator=g).tolist()
    prompts = [motif * 3, (motif[5:] + motif[:5]) * 3, motif[:12] * 4]  # repeats: n-gram drafts exist
    params = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
    out = eng.generate(prompts, params)
    again = eng.generate(prompts, params)  # answers cached: drafts from the radix tree too
    assert all(len(o.output_ids) == 40 for o in out + again)
    st = eng.core.state.spec_stats
    assert st.rows > 0 and st.accepted > 0
    assert eng.runner.spec is not None and eng.runner.spec.replayed > 0
    assert eng.runner.graphs is not None and eng.runner.graphs.replays >= eng.runner.spec.replayed
    assert eng.core.leak_free()
