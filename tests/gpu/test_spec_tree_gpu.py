"""NGRAM draft trees on CUDA (float32): the tree's acceptance and its K/V compaction on the device
equal the CPU's; a tiny random Llama on the GPU with the torch attention backend answers the plain
engine's greedy tokens with trees, with no page left behind, and so do a random EAGLE head's
chain with leaves and a random MTP layer's on a DeepSeek-V3 target (MLABackend). On CUDA's default
backend (flashinfer, bf16) a tree's custom mask attends as the torch backend does, and an engine
with trees runs end to end as the torch backend's does (an attention-free model)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))  # model_harness, test_mla
import test_draft_heads as heads  # noqa: E402

from engine.config import ServerConfig  # noqa: E402
from engine.layers.kv_pool import KVPool  # noqa: E402
from engine.local import LocalEngine  # noqa: E402
from engine.run.sample_params import SampleParams  # noqa: E402
from engine.run.sampler import Sampler  # noqa: E402
from engine.run.spec import VerifyRows  # noqa: E402
from engine.run.spec_tree import accept_tree, compact, depths  # noqa: E402
from msgs.codec import unpack_ids  # noqa: E402
from msgs.params import SamplingParams  # noqa: E402
from msgs.steps import Step  # noqa: E402
from tests.models.draft_heads import write_head  # noqa: E402

DEVICE = "cuda"  # (the engine tests' logic can be checked on "cpu")
PARENTS = [[-1, -1, 0, 1, 1, 3], [-1, 0, 0, 1], [-1, 0, 1]]


def _accept(device: str, logits: torch.Tensor, drafts: list[list[int]], temperature: float
            ) -> tuple[list[int], list[int], list[int], list[list[int]]]:
    sampler = Sampler(logits.shape[1], 4, device)
    for s in range(len(drafts)):
        sampler.add(s, SampleParams(seed=s + 7, temperature=temperature))
    row_slots = [s for s, p in enumerate(PARENTS) for _ in range(len(p) + 1)]
    positions = [40 + 1 + d for p in PARENTS for d in depths(p)]
    res = sampler.sample(logits.to(device), row_slots, positions)
    v = VerifyRows([len(d) for d in drafts], drafts, [len(d) for d in drafts], parents=PARENTS)
    keep, accepted, bonus, path = accept_tree(res, v, None)
    return keep.tolist(), accepted.tolist(), bonus.tolist(), path.tolist()


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_tree_acceptance_on_cuda_equals_cpu(temperature: float) -> None:
    torch.manual_seed(1)
    logits = torch.randn(sum(len(p) + 1 for p in PARENTS), 50)
    arg = logits.argmax(-1).tolist()  # drafts partly right (greedy), so paths of several lengths
    drafts = [[arg[0], (arg[0] + 1) % 50, arg[1], arg[2], 3, arg[4]], [arg[7], arg[8], 5, arg[9]],
              [arg[12], (arg[13] + 2) % 50, 9]]
    cpu = _accept("cpu", logits, drafts, temperature)
    assert _accept("cuda", logits, drafts, temperature) == cpu
    if temperature == 0.0:
        assert cpu[1] == [2, 3, 1]


def test_tree_compaction_on_cuda_equals_cpu() -> None:
    out = []
    for device in ("cpu", "cuda"):
        kv = KVPool(3, 8, 4, 2, 8, torch.bfloat16, device)
        g = torch.Generator().manual_seed(0)
        for t in kv.all.values():
            t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
        slots = [[13, 14, 15, 20, 21, 22, 23], [5, 6, 7, 8, 9]]
        v = VerifyRows([6, 4], [[1] * 6, [2] * 4], [6, 4], parents=[PARENTS[0], PARENTS[1]], kv_slots=slots)
        path = torch.tensor([[0, 2, 4, 6, -1, -1, -1], [0, 1, 3, -1, -1, -1, -1]], device=device)
        compact([kv], v, path, torch.tensor([3, 2], device=device))
        out.append([t.cpu() for t in kv.all.values()])
    assert all(torch.equal(a, b) for a, b in zip(*out, strict=True))


def test_tree_engine_on_cuda_greedy_equals_plain(tmp_path: Path) -> None:
    model = heads._llama(tmp_path / "target", heads.TINY, attention_free=False)
    pattern = heads._prompts([9, 7, 11], seed=4)
    prompts = [p * 4 for p in pattern] + [heads._prompts([30], seed=5)[0]]  # repeats: n-gram trees
    params = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    common = dict(model=str(model), dtype="float32", max_total_tokens=2048, max_running_requests=8, page_size=4,
                  device=DEVICE, attention_backend="torch")
    want = [r.output_ids for r in LocalEngine(ServerConfig(**common)).generate(prompts, params)]
    eng = LocalEngine(ServerConfig(**common, speculative_algorithm="NGRAM", speculative_eagle_topk=3,
                                   speculative_num_draft_tokens=8, max_prefill_tokens=16))
    steps: list[Step] = []
    plan = eng.core.plan

    def record() -> Step | None:
        step = plan()
        if step is not None:
            steps.append(step)
        return step

    eng.core.plan = record  # type: ignore[method-assign]
    assert [r.output_ids for r in eng.generate(prompts, params)] == want
    assert [r.output_ids for r in eng.generate(prompts, params)] == want  # from the prefix cache
    trees = [unpack_ids(s.forward.drafts.parents) for s in steps
             if s.forward is not None and s.forward.drafts is not None and s.forward.drafts.parents]
    assert any(any(p != i - 1 for i, p in enumerate(t)) for t in trees)
    assert eng.core.state.spec_stats.accepted > 0 and eng.core.leak_free()


def test_flashinfer_tree_mask_equals_torch(flashinfer_built: None) -> None:
    """Two tree requests beside a causal chunk and a decode (so each request's byte offset into
    the packed mask matters), bf16, head dim 128: flashinfer's prefill with the custom mask
    against the torch backend with the same trees; then a causal step on the same wrapper."""
    import random

    from engine.layers.attention import TorchAttention
    from engine.layers.flashinfer_attention import FlashInferAttention
    from engine.layers.forward import ForwardBatch

    hq, hkv, d, ps = 8, 2, 128, 4
    pools = [KVPool(1, 128, ps, hkv, d, torch.bfloat16, DEVICE) for _ in range(2)]
    backends = [TorchAttention(DEVICE), FlashInferAttention(DEVICE)]
    for be, pool in zip(backends, pools, strict=True):
        be.bind(num_q_heads=hq, kv_pool=pool, max_batch=8, max_pages_per_req=32)
    free = list(range(1, 128))
    random.Random(3).shuffle(free)
    pa, pb, pc = free[:16], free[16:28], free[28:40]
    g = torch.Generator(device=DEVICE).manual_seed(3)

    def step(reqs: list, trees: dict[int, torch.Tensor], qkv: tuple | None = None) -> list[torch.Tensor]:
        batch = ForwardBatch.from_requests(reqs, ps, DEVICE)
        t = batch.num_tokens
        q, k, v = qkv or (torch.randn(t, h, d, generator=g, device=DEVICE).to(torch.bfloat16) for h in (hq, hkv, hkv))
        inputs[:] = [q, k, v]
        outs = []
        for be, pool in zip(backends, pools, strict=True):
            if trees:
                be.set_tree_masks(trees)
            be.prepare(batch)
            outs.append(be.forward(q, k, v, 0, batch, pool).float())
        return outs

    inputs: list[torch.Tensor] = []
    step([([1] * 37, 0, pa), ([2] * 21, 0, pb), ([3] * 29, 0, pc)], {})
    tree = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0], [1, 1, 0, 1, 0, 0],
                         [1, 0, 1, 0, 1, 0], [1, 0, 0, 0, 0, 1]], dtype=torch.bool, device=DEVICE)
    ref, got = step([([4] * 6, 37, pa), ([5], 21, pb), ([6] * 4, 29, pc)], {0: tree, 2: tree[:4, :4]})
    torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)
    causal = step([([4] * 6, 37, pa), ([5], 21, pb), ([6] * 4, 29, pc)], {}, tuple(inputs))[1]
    assert (causal - got).abs().max() > 0.05  # the trees changed the answer (rows skip siblings)
    ref, got = step([([7] * 9, 43, pa), ([8] * 3, 22, pb)], {})
    torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)


def test_tree_engine_on_flashinfer_equals_torch(tmp_path: Path, flashinfer_built: None,
                                                 dummy_models: dict[str, Path]) -> None:
    """NGRAM trees through CUDA's default backend in bf16 end to end: an attention-free Llama
    (head dim 128; o_proj zero, so the attention's values cannot move a logit) answers, step for
    step, the torch backend's tokens with the same trees (the same GEMM shapes: the same bits).
    Not plain decoding's: in bf16 a verify row's GEMM shape rounds differently from a decode
    row's, and a random model's near ties flip (seen on the H200: 760 against 1360)."""
    import json

    cfg = json.loads((dummy_models["llama-h128"] / "config.json").read_text())
    model = heads._llama(tmp_path / "target", cfg, attention_free=True)
    pattern = heads._prompts([9, 7, 11], seed=4)
    prompts = [p * 4 for p in pattern] + [heads._prompts([30], seed=5)[0]]
    params = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    common = dict(model=str(model), dtype="bfloat16", max_total_tokens=4096, max_running_requests=8, page_size=16,
                  device=DEVICE)
    trees = dict(speculative_algorithm="NGRAM", speculative_eagle_topk=3, speculative_num_draft_tokens=8)
    ref = LocalEngine(ServerConfig(**common, **trees, attention_backend="torch"))
    want = [r.output_ids for r in ref.generate(prompts, params)]
    eng = LocalEngine(ServerConfig(**common, **trees))
    assert type(eng.runner.backend).__name__ == "FlashInferAttention"
    assert [r.output_ids for r in eng.generate(prompts, params)] == want
    st = eng.core.state.spec_stats
    assert st.accepted > 0 and st.accepted == ref.core.state.spec_stats.accepted and eng.core.leak_free()


def test_eagle_leaf_trees_on_cuda_greedy_equal_plain(tmp_path: Path) -> None:
    """A random EAGLE head's chain with leaves (its next best tokens) on the GPU: the accepted path
    compacted in the target's KV, the head's KV and its hidden pool on the device; plain tokens."""
    target = heads._llama(tmp_path / "target", heads.TINY, attention_free=False)
    head = write_head(tmp_path / "head", heads.TINY, "EAGLE", layers=1)
    prompts = heads._prompts([9, 23, 4], seed=2)
    params = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
    common = dict(model=str(target), dtype="float32", max_total_tokens=2048, max_running_requests=8, page_size=4,
                  device=DEVICE, attention_backend="torch")
    want = [r.output_ids for r in LocalEngine(ServerConfig(**common)).generate(prompts, params)]
    eng = LocalEngine(ServerConfig(**common, speculative_algorithm="EAGLE", speculative_draft_model_path=str(head),
                                   speculative_eagle_topk=3, speculative_num_draft_tokens=8, max_prefill_tokens=8))
    assert [r.output_ids for r in eng.generate(prompts, params)] == want
    assert [r.output_ids for r in eng.generate(prompts, params)] == want  # from the prefix cache
    st = eng.core.state.spec_stats
    assert st.drafted > 3 * st.rows and eng.core.leak_free()


def test_mtp_leaf_trees_on_cuda_mla_backend_greedy_equal_plain(tmp_path: Path) -> None:
    """NEXTN's leaves on a DeepSeek-V3 target on the GPU: MLABackend (what CUDA binds for MLA)
    takes the tree masks into the tree rows' expanded attention; the plain engine's tokens."""
    target = heads._v3_with_mtp(tmp_path / "v3", heads.V3_MOE)
    prompts = heads._prompts([27, 7, 3], seed=2)
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    common = dict(model=str(target), dtype="float32", max_total_tokens=2048, max_running_requests=8, page_size=4,
                  device=DEVICE)
    want = [r.output_ids for r in LocalEngine(ServerConfig(**common)).generate(prompts, params)]
    eng = LocalEngine(ServerConfig(**common, speculative_algorithm="NEXTN", speculative_num_steps=2,
                                   speculative_eagle_topk=3, speculative_num_draft_tokens=6, max_prefill_tokens=8))
    assert type(eng.runner.backend).__name__ == "MLABackend"
    assert [r.output_ids for r in eng.generate(prompts, params)] == want
    assert [r.output_ids for r in eng.generate(prompts, params)] == want  # from the prefix cache
    assert eng.core.state.spec_stats.drafted > 0 and eng.core.leak_free()
