"""EAGLE, EAGLE3 and NEXTN draft heads on tiny random targets (float32, CPU; engine/run/eagle.py).

- The hidden pool holds the target's hidden states as transformers computes them (EAGLE: the
  final one after the norm; EAGLE3: fc over the outputs of the layers its config names).
- A head's drafts do not depend on how the prompt was chunked or paged.
- High acceptance by construction: an attention-free target (every o_proj zero) answers a
  function of the current token only, g(t). An EAGLE head that copies its layers, reads the
  embedding (fc = [I | 0]) and ends in the target's LM head computes g too, so its chain of 3
  drafts is the target's greedy continuation; likewise an MTP layer copying the target's one
  layer (eh_proj = [I | 0], unit-RMS embeddings); an EAGLE3 head whose fc picks the stream after
  layer 0 at p, whose draft vocabulary holds one row per token (that stream, normalized) and
  whose d2t maps row t to g(g(t)) proposes token p + 2 right wherever token p + 1 = g(t_p), i.e.
  after the prompt (one draft a step: its chain does not advance). A head misaligned by one
  position, or a wrong d2t, would fail these.
- With random heads (and a random MTP layer on a DeepSeek-V3 with MoE), greedy tokens with
  speculation equal those without, batched, chunked, from the prefix cache, without page leaks;
  seeded sampled ones too.
- Bad heads fail at start naming the flag.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from model_harness import CONFIGS
from safetensors.torch import load_file, save_file
from test_mla import TINY_V3, make_v3_dir
from transformers import AutoConfig, AutoModelForCausalLM

from engine.config import ServerConfig
from engine.layers.forward import ForwardBatch
from engine.local import LocalEngine, Result
from msgs.params import SamplingParams
from tests.models.draft_heads import write_head

TINY = {**json.loads((CONFIGS / "tiny-llama" / "config.json").read_text()), "num_hidden_layers": 4}
GREEDY = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
LONG = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)  # long enough for streaks (chained rows)


def _prompts(lengths: list[int], seed: int = 0, vocab: int = 256) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


DEVICE = "cpu"  # tests/gpu/test_spec_heads_gpu.py runs the engine-level tests here on "cuda"


def _engine(model: Path, **kw: object) -> LocalEngine:
    return LocalEngine(ServerConfig(model=str(model), dtype="float32", max_total_tokens=2048, max_running_requests=8,
                                    page_size=4, cpu_threads=1, device=DEVICE, **kw))  # type: ignore[arg-type]


def _ids(results: list[Result]) -> list[list[int]]:
    assert all(r.finish_reason == "length" for r in results), results
    return [r.output_ids for r in results]


def _llama(path: Path, config: dict, attention_free: bool, seed: int = 0) -> Path:
    """A random Llama checkpoint saved by transformers; attention_free: every o_proj zero and the
    final norm's weight 1 (its argmax then equals the un-normed stream's)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
            if attention_free and (name.endswith("o_proj.weight") or name == "model.norm.weight"):
                p.fill_(0.0 if "o_proj" in name else 1.0)
    model.save_pretrained(path, safe_serialization=True)
    return path


def _greedy_map(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """For an attention-free target: g[t] (its greedy next token after t, wherever t is) and the
    residual stream after layer 0 for every token, from transformers."""
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = hf(input_ids=torch.arange(hf.config.vocab_size)[:, None], output_hidden_states=True)
    return out.logits[:, -1].argmax(-1), out.hidden_states[1][:, 0]


def _in_graphs(eng: LocalEngine) -> None:
    """Where the target is captured (on CUDA: tests/gpu/test_spec_heads_gpu.py), its chains verify
    by replaying the decode graphs; where a draft head is captured too, its draft steps and the
    rows it follows replay its own."""
    spec = eng.runner.spec
    assert spec is not None
    if eng.runner.graphs is not None:
        assert spec.replayed > 0, "no verify step replayed the graphs"
    head_graphs = getattr(spec.draft, "graphs", None)
    if head_graphs is not None:
        assert head_graphs.replays > 0, "the head's graphs were captured, never replayed"


def _spec_run(path: Path, prompts: list[list[int]], params: SamplingParams, **kw: object) -> tuple[list, object]:
    eng = _engine(path, **kw)
    got = _ids(eng.generate(prompts, params))
    assert eng.core.leak_free()
    _in_graphs(eng)
    return got, eng.core.state.spec_stats


def test_eagle_reproducing_an_attention_free_target_has_every_draft_accepted(tmp_path: Path) -> None:
    cfg = {**TINY, "num_hidden_layers": 2}
    target = _llama(tmp_path / "t", cfg, attention_free=True)
    sd = load_file(str(target / "model.safetensors"))
    h = cfg["hidden_size"]
    copy = {k[len("model."):]: v for k, v in sd.items() if k.startswith("model.layers.")}
    copy.pop("layers.0.input_layernorm.weight")  # EAGLE's layer 0 has none (irrelevant: no attention output)
    fc = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
    head = write_head(tmp_path / "h", cfg, "EAGLE", layers=2, inter=cfg["intermediate_size"],
                      tensors={**copy, "fc.weight": fc, "fc.bias": torch.zeros(h)})
    prompts = _prompts([9, 23, 4])
    want = _ids(_engine(target).generate(prompts, LONG))
    got, st = _spec_run(target, prompts, LONG, speculative_algorithm="EAGLE", speculative_draft_model_path=str(head),
                        max_prefill_tokens=8)
    assert got == want
    assert st.drafted > 0 and st.accepted == st.drafted, st  # 3 drafts a step, all the target's
    # under overlap, after a streak of full acceptances the next row is chained on the row in
    # flight: drafted on the worker from that row's bonus, still on the device
    assert st.chained > 0 and st.void == 0, st


def test_eagle3_with_a_draft_vocabulary_and_d2t_proposes_token_p_plus_2(tmp_path: Path) -> None:
    target = _llama(tmp_path / "t", TINY, attention_free=True)
    g, stream = _greedy_map(target)
    v, h = TINY["vocab_size"], TINY["hidden_size"]
    rows = stream / stream.pow(2).mean(-1, keepdim=True).sqrt()  # what the head's norm (weight 1) gives
    zero = torch.zeros(h, h)
    tensors = {"fc.weight": torch.cat([torch.eye(h), zero, zero], dim=1), "norm.weight": torch.ones(h),
               "midlayer.self_attn.o_proj.weight": zero, "midlayer.mlp.down_proj.weight": torch.zeros(h, 128),
               "lm_head.weight": rows, "d2t": g[g] - torch.arange(v)}
    head = write_head(tmp_path / "h", TINY, "EAGLE3", tensors=tensors, draft_vocab_size=v,
                      eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 2, 1]})
    prompts = _prompts([9, 23, 4], seed=1)
    want = _ids(_engine(target).generate(prompts, GREEDY))
    got, st = _spec_run(target, prompts, GREEDY, speculative_algorithm="EAGLE3", speculative_num_steps=1,
                        speculative_draft_model_path=str(head), max_prefill_tokens=8)
    assert got == want
    # the head reads h_p only: its draft is g(g(t_p)), token p + 2 whenever t_{p+1} = g(t_p), that
    # is every time but when t_{p+1} is a prompt's last token (at most once a prompt)
    assert st.drafted > len(prompts) and st.accepted >= st.drafted - len(prompts), st


def test_the_target_as_its_own_separate_draft_model_has_its_drafts_accepted(tmp_path: Path) -> None:
    """A separate draft model (STANDALONE) follows every target forward to keep its KV whole: as the
    target itself, its drafts are the target's greedy tokens wherever its KV followed the prefill
    chunks, the plain decode rows and the verify rows (on CUDA: replays of the decode graphs)."""
    target = _llama(tmp_path / "t", TINY, attention_free=False)
    prompts = _prompts([9, 23, 4], seed=3)
    want = _ids(_engine(target).generate(prompts, LONG))
    got, st = _spec_run(target, prompts, LONG, speculative_algorithm="STANDALONE", speculative_num_steps=3,
                        speculative_draft_model_path=str(target), max_prefill_tokens=8)
    assert got == want
    assert st.drafted > 0 and st.accepted >= 0.9 * st.drafted, st
    assert st.chained > 0, st  # rows chained on the row in flight, drafted from its bonus on the worker


def test_a_separate_drafts_chained_rows_void_after_a_rejection(tmp_path: Path) -> None:
    """Rows drafted on the worker chain under overlap too: after a streak of full acceptances a
    row is planned before the one in flight answers, its first token that row's bonus (on the
    device), and answers nothing where that row rejected a draft. A draft model that is the
    target with a little noise in its MLPs agrees with it mostly, not always: both happen, and
    the tokens are plain decoding's, with no page left behind."""
    target = _llama(tmp_path / "t", TINY, attention_free=False)
    prompts = _prompts([9, 23, 4, 30], seed=3)
    want = _ids(_engine(target).generate(prompts, LONG))
    chained = void = 0
    for noise in (0.003, 0.005):
        draft = tmp_path / f"d{noise}"
        draft.mkdir()
        for f in target.iterdir():
            (draft / f.name).write_bytes(f.read_bytes())
        g = torch.Generator().manual_seed(1)
        sd = {k: v + noise * torch.randn(v.shape, generator=g) if k.endswith("down_proj.weight") else v
              for k, v in load_file(str(target / "model.safetensors")).items()}
        save_file(sd, str(draft / "model.safetensors"), metadata={"format": "pt"})
        got, st = _spec_run(target, prompts, LONG, speculative_algorithm="STANDALONE", speculative_num_steps=3,
                            speculative_draft_model_path=str(draft), max_prefill_tokens=8)
        assert got == want
        assert 0 < st.accepted < st.drafted, st
        chained, void = chained + st.chained, void + st.void
    assert chained > void > 0, (chained, void)


def _v3_with_mtp(path: Path, config: dict, seed: int = 3) -> Path:
    """A tiny DeepSeek-V3 checkpoint with a random MTP layer (model.layers.{L}, in its own file):
    the shapes of its last decoder layer (an MoE one) plus enorm, hnorm, eh_proj, shared_head.norm."""
    make_v3_dir(path, {**config, "num_nextn_predict_layers": 1})
    last, mtp_at = config["num_hidden_layers"] - 1, config["num_hidden_layers"]
    sd = load_file(str(path / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    h = config["hidden_size"]
    mtp = {k.replace(f".{last}.", f".{mtp_at}.", 1): torch.randn(v.shape, generator=gen) * 0.1
           for k, v in sd.items() if k.startswith(f"model.layers.{last}.")}
    for n in ("enorm", "hnorm", "shared_head.norm"):
        mtp[f"model.layers.{mtp_at}.{n}.weight"] = 1 + 0.1 * torch.randn(h, generator=gen)
    mtp[f"model.layers.{mtp_at}.eh_proj.weight"] = 0.1 * torch.randn(h, 2 * h, generator=gen)
    save_file(mtp, str(path / "mtp.safetensors"))
    return path


V3_MOE = {**TINY_V3, "num_hidden_layers": 2, "first_k_dense_replace": 1}


def test_nextn_random_mtp_greedy_equals_plain_batched_cached_chunked(tmp_path: Path) -> None:
    target = _v3_with_mtp(tmp_path / "v3", V3_MOE)
    prompts = _prompts([27, 7, 3], seed=2)
    params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    plain = _engine(target)
    want = _ids(plain.generate(prompts, params))
    eng = _engine(target, speculative_algorithm="NEXTN", speculative_num_steps=2, max_prefill_tokens=8)
    assert _ids(eng.generate(prompts, params)) == want
    again = eng.generate(prompts, params)
    assert _ids(again) == want and again[0].cached_tokens >= 24
    # seeded sampling: each answered token drawn as a one-token step would (exact rejection sampling)
    sampled = SamplingParams(max_new_tokens=8, temperature=0.8, top_p=0.95, seed=5, ignore_eos=True)
    assert _ids(eng.generate(prompts[:2], sampled)) == _ids(plain.generate(prompts[:2], sampled))
    st = eng.core.state.spec_stats
    assert st.rows > 0 and st.drafted >= st.rows and 0 <= st.accepted <= st.drafted
    assert eng.core.leak_free()
    _in_graphs(eng)


@pytest.mark.parametrize("algo", ["NEXTN", "NGRAM"])
def test_trees_on_an_mla_target_equal_plain(algo: str, tmp_path: Path) -> None:
    """Draft trees (--speculative-eagle-topk 3) on a DeepSeek-V3 target: MTP leaves beside its
    chain, or NGRAM's radix/n-gram branches; the MLA attention takes each tree's mask
    (tests/models/test_tree_attention.py checks the logits node by node)."""
    target = _v3_with_mtp(tmp_path / "v3", V3_MOE)
    prompts = _prompts([27, 7, 3], seed=2)
    params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    want = _ids(_engine(target).generate(prompts, params))
    steps = 2 if algo == "NEXTN" else 3
    eng = _engine(target, speculative_algorithm=algo, speculative_num_steps=steps, speculative_eagle_topk=3,
                  speculative_num_draft_tokens=steps + 4, max_prefill_tokens=8)
    assert _ids(eng.generate(prompts, params)) == want
    assert _ids(eng.generate(prompts, params)) == want  # cached
    assert eng.core.state.spec_stats.drafted > 0 and eng.core.leak_free()


@pytest.mark.parametrize("kind", ["llama-ngram", "v3-nextn"])
def test_draft_trees_at_tp2_give_tp1_plain_tokens(kind: str, tmp_path: Path) -> None:
    """Draft trees over 2 ranks (gloo, replica digests checked every step): NGRAM's branches on a
    Llama target, MTP leaves beside the chain on a DeepSeek-V3 target (MLA's tree mask, MoE);
    tp=1's plain greedy tokens, with a repetitive prompt so that the n-grams branch."""
    from tp_harness import run_tp

    if kind == "llama-ngram":
        target = _llama(tmp_path / "t", TINY, attention_free=False)
        spec = dict(speculative_algorithm="NGRAM", speculative_num_steps=3, speculative_num_draft_tokens=8)
    else:
        target = _v3_with_mtp(tmp_path / "v3", V3_MOE)
        spec = dict(speculative_algorithm="NEXTN", speculative_num_steps=2, speculative_num_draft_tokens=6)
    params = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)
    shared, loop = _prompts([13], seed=7)[0], [3, 4, 5] * 9
    waves = [([shared + p for p in _prompts([9, 4], seed=8)] + [loop], params), ([shared + [5, 6], loop], params)]
    plain = _engine(target, max_prefill_tokens=8)
    want = [_ids(plain.generate(prompts, p)) for prompts, p in waves]
    cfg = ServerConfig(model=str(target), device="cpu", dtype="float32", tp_size=2, cpu_threads=1, page_size=4,
                       max_prefill_tokens=8, max_total_tokens=1024, max_running_requests=4,
                       speculative_eagle_topk=3, **spec)  # type: ignore[arg-type]
    assert [[o.output_ids for o in w] for w in run_tp(cfg, waves)] == want


def test_nextn_copying_an_attention_free_target_has_its_drafts_accepted(tmp_path: Path) -> None:
    cfg = {**TINY_V3, "num_hidden_layers": 1, "first_k_dense_replace": 0}  # one MoE layer
    path = make_v3_dir(tmp_path / "v3", {**cfg, "num_nextn_predict_layers": 1})
    sd = load_file(str(path / "model.safetensors"))
    e = sd["model.embed_tokens.weight"]
    sd["model.embed_tokens.weight"] = e / e.pow(2).mean(-1, keepdim=True).sqrt()  # enorm (weight 1) keeps it
    sd["model.layers.0.self_attn.o_proj.weight"].zero_()
    save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})
    h = cfg["hidden_size"]
    mtp = {k.replace("layers.0.", "layers.1.", 1): v for k, v in sd.items() if k.startswith("model.layers.0.")}
    mtp |= {"model.layers.1.enorm.weight": torch.ones(h), "model.layers.1.hnorm.weight": torch.ones(h),
            "model.layers.1.eh_proj.weight": torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1),
            "model.layers.1.shared_head.norm.weight": sd["model.norm.weight"]}
    save_file(mtp, str(path / "mtp.safetensors"))
    prompts = _prompts([11, 5], seed=4)
    want = _ids(_engine(path).generate(prompts, LONG))
    got, st = _spec_run(path, prompts, LONG, speculative_algorithm="NEXTN")
    assert got == want
    assert st.drafted > 0 and st.accepted >= 0.95 * st.drafted, st


@pytest.fixture(scope="module")
def eagle3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LocalEngine]:
    root = tmp_path_factory.mktemp("eagle3")
    target = _llama(root / "t", TINY, attention_free=False)
    head = write_head(root / "h", TINY, "EAGLE3", draft_vocab=64, eagle_config={"eagle_aux_hidden_state_layer_ids":
                                                                                  [0, 1, 2]})
    return target, _engine(target, speculative_algorithm="EAGLE3", speculative_draft_model_path=str(head))


def _prefill(eng: LocalEngine, prompt: list[int], pages: list[int], chunks: list[int]) -> None:
    """The runner's forward and the head's follow, chunk by chunk, in `pages`."""
    runner, start = eng.runner, 0
    for n in chunks:
        batch = ForwardBatch.build(prompt[start : start + n], [start], [n], [pages], [1], 4, "cpu")
        runner.backend.prepare(batch)
        runner.model(batch, runner.kv, runner.backend)
        runner.spec.follow(batch)
        start += n


def test_hidden_pool_holds_the_targets_hidden_states(eagle3: tuple[Path, LocalEngine], tmp_path: Path) -> None:
    """EAGLE3: fc over the outputs of layers 0, 1, 2 (transformers' hidden_states[1..3], the tap
    in the config's order); EAGLE (and NEXTN): the final hidden state, after the target's norm
    (transformers' last hidden_states)."""
    target, eng3 = eagle3
    eagle = write_head(tmp_path / "h", TINY, "EAGLE")
    eng = _engine(target, speculative_algorithm="EAGLE", speculative_draft_model_path=str(eagle))
    prompt = _prompts([13], seed=5)[0]
    pages = [7, 3, 9, 4]
    slots = torch.tensor([pages[p // 4] * 4 + p % 4 for p in range(13)])
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    with torch.inference_mode():
        hs = hf(input_ids=torch.tensor([prompt]), output_hidden_states=True).hidden_states
        draft = eng3.runner.spec.draft
        assert draft.tap.which == [0, 1, 2]
        _prefill(eng3, prompt, pages, [13])
        want = draft.head.fc(torch.cat([hs[1][0], hs[2][0], hs[3][0]], dim=-1))
        torch.testing.assert_close(draft.hidden[slots], want, atol=1e-4, rtol=0)
        _prefill(eng, prompt, pages, [5, 8])
        torch.testing.assert_close(eng.runner.spec.draft.hidden[slots], hs[-1][0], atol=1e-4, rtol=0)


def test_drafts_do_not_depend_on_chunks_or_pages(eagle3: tuple[Path, LocalEngine]) -> None:
    """The head's KV entries and hidden states follow the target's pages: the same prompt prefilled
    at once or in 3 chunks, in other pages, gives the same 3 drafts (all from the draft vocabulary)."""
    _, eng = eagle3
    prompt = _prompts([14], seed=6)[0]
    hot = set((torch.arange(64) + eng.runner.spec.draft.head.d2t).tolist())
    drafts = []
    for pages, chunks in (([5, 6, 7, 8, 9], [14]), ([12, 2, 30, 11, 17], [5, 4, 5])):
        _prefill(eng, prompt[:-1], pages, chunks[:-1] + [chunks[-1] - 1])
        ids = [prompt[-1], -1, -1, -1]
        eng.runner.spec.draft.propose(ids, [(0, 3, 13, pages)])  # the row [last token at 13, 3 drafts]
        drafts.append(ids[1:])
    assert drafts[0] == drafts[1] and set(drafts[0]) <= hot


def test_bad_heads_fail_at_start_naming_the_flag(tmp_path: Path) -> None:
    target = _llama(tmp_path / "t", TINY, attention_free=False)
    narrow = write_head(tmp_path / "narrow", {**TINY, "hidden_size": 32}, "EAGLE3")
    with pytest.raises(ValueError, match="--speculative-draft-model-path .* hidden states of 32 values, the model's"):
        ServerConfig(model=str(target), speculative_algorithm="EAGLE3", speculative_draft_model_path=str(narrow))
    far = write_head(tmp_path / "far", TINY, "EAGLE3", eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 9]})
    with pytest.raises(ValueError, match="--speculative-draft-model-path .* layers \\[0, 1, 9\\]; the model has 4"):
        _engine(target, speculative_algorithm="EAGLE3", speculative_draft_model_path=str(far))
    with pytest.raises(ValueError, match="--speculative-algorithm NEXTN: .* has no MTP layer"):
        ServerConfig(model=str(target), speculative_algorithm="NEXTN")
    v3 = make_v3_dir(tmp_path / "v3", {**V3_MOE, "num_nextn_predict_layers": 1})  # config says 1, no weights
    with pytest.raises(ValueError, match="--speculative-algorithm NEXTN: the checkpoint .* lacks the MTP layer"):
        _engine(v3, speculative_algorithm="NEXTN")


def test_heads_at_tp2_give_tp1_plain_tokens(tmp_path: Path) -> None:
    """An EAGLE3 head over 2 ranks (gloo; every rank's replica digest checked every step), with its
    own embedding and draft-vocabulary head (wide q/k/v column-parallel, o_proj row-parallel, the
    draft logits gathered): tp=1's plain greedy tokens, prefill chunks and a cached prefix included.
    (The MTP layer's MLA and MoE are the target's layer code, tested at tp=2 in test_mla.py.)"""
    from tp_harness import run_tp

    target = _llama(tmp_path / "t", TINY, attention_free=False)
    head = write_head(tmp_path / "h", TINY, "EAGLE3", draft_vocab=64,
                      tensors={"embed_tokens.weight": 0.1 * torch.randn(TINY["vocab_size"], TINY["hidden_size"])})
    params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    shared = _prompts([13], seed=7)[0]
    waves = [([shared + p for p in _prompts([9, 4], seed=8)], params), ([shared + [5, 6]], params)]
    plain = _engine(target, max_prefill_tokens=8)
    want = [_ids(plain.generate(prompts, p)) for prompts, p in waves]
    cfg = ServerConfig(model=str(target), device="cpu", dtype="float32", tp_size=2, cpu_threads=1, page_size=4,
                       max_prefill_tokens=8, max_total_tokens=1024, max_running_requests=4,
                       speculative_algorithm="EAGLE3", speculative_draft_model_path=str(head))
    assert [[o.output_ids for o in w] for w in run_tp(cfg, waves)] == want
