"""Draft-tree verify forwards at the model level (float32, CPU): a speculative tree row [first
token, nodes...] behind a cached prompt, each node at its depth's position and attending only the
prompt and its ancestors (TorchAttention.set_tree_masks, as engine/run/spec_tree.py's tree_batch
sets them), gives every node the logits of a plain forward of prompt + its root-to-node path.
For a Llama-family model (the torch backend's mask) and for an MLA model (DeepSeek-V3, which
attends its latent pool itself: MLAPlan reads the step's trees from the torch backend or from
MLABackend, the one CUDA binds). Siblings come first in row
order, so a causal mask by row would let a node see them: the test fails without the tree mask."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from engine.layers.forward import ForwardBatch
from engine.layers.mla_attention import MLABackend
from engine.run.spec_tree import ancestors, depths, paths
from models.registry import load_model
from tests.models.model_harness import PagedGreedy, make_hf_dir, tiny_config
from tests.models.test_mla import TINY_V3, make_v3_dir

PARENTS = [-1, -1, 0, 1, 1, 3, -1]  # three children of the first token, a branch of two, a chain of three
PROMPT = [5, 17, 42, 9, 77, 31, 8, 23, 61, 14, 3]


@pytest.fixture(scope="module", params=["llama", "deepseek-v3", "deepseek-v3-mla-backend"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    """(model, config, backend): the torch backend, or for MLA also MLABackend (what CUDA binds;
    its tree rows take the same expanded torch path, here on the CPU)."""
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "llama":
        make_hf_dir(path, tiny_config("tiny-llama"))
    else:
        make_v3_dir(path, {**TINY_V3, "num_hidden_layers": 2, "first_k_dense_replace": 1})
    yield *load_model(path, progress=False), request.param.endswith("mla-backend")


def _last_logits(run: PagedGreedy, tokens: list[int]) -> torch.Tensor:
    seq = run.new_seq(tokens, 0)
    batch = ForwardBatch.build(tokens, [0], [len(tokens)], [seq.pages], [1], run.page_size, "cpu")
    run.backend.prepare(batch)
    return run.model(batch, run.kv, run.backend)[0]


def test_tree_nodes_get_their_paths_logits(model: tuple) -> None:
    net, cfg, mla_backend = model
    run = PagedGreedy(net, cfg)
    if mla_backend:
        run.backend = MLABackend("cpu")
        run.backend.bind(num_q_heads=cfg.num_heads, kv_pool=run.kv, max_batch=8, max_pages_per_req=64)
    g = torch.Generator().manual_seed(0)
    first = 88
    drafts = torch.randint(3, cfg.vocab_size, (len(PARENTS),), generator=g).tolist()
    n, p0 = len(PARENTS) + 1, len(PROMPT)
    seq = run.new_seq(PROMPT, n)
    prefill = ForwardBatch.build(PROMPT, [0], [p0], [seq.pages], [0], run.page_size, "cpu")
    run.backend.prepare(prefill)
    run.model(prefill, run.kv, run.backend)
    # the tree row: KV slots in row order, positions at depth, every row's logits
    row = [first, *drafts]
    batch = ForwardBatch.build(row, [p0], [n], [seq.pages], [1], run.page_size, "cpu")
    batch.positions = torch.tensor([p0 + d for d in depths(PARENTS)], dtype=torch.int64)
    batch.logit_indices = torch.arange(n)
    run.backend.set_tree_masks({0: ancestors(PARENTS)})  # the row's first token is the root
    run.backend.prepare(batch)
    got = run.model(batch, run.kv, run.backend)
    assert run.backend.step_trees  # the step's trees are there for models that attend themselves
    for r, path in enumerate(paths(drafts, PARENTS)):
        want = _last_logits(run, [*PROMPT, first, *path])
        torch.testing.assert_close(got[r], want, rtol=1e-5, atol=1e-5, msg=f"node row {r} (path {path})")
