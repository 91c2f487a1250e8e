"""bin/serve --cp-size 2 on CPU (gloo): a request's KV pages round robin over two worker
processes (docs/architecture.md, Context parallelism), each pool holding only the pages its rank
owns. Greedy tokens equal cp=1's for long prompts (several pages per rank, lengths not multiples
of cp x page) in chunks, batched (overlap on), behind a cached prefix, loaded back from the shared
host tier (L2) and read from the disk tier (L3), which a cp=1 engine then serves from the same
directory; each rank's pool holds about half the pages; tp=2 x cp=2 on four workers gives the same
tokens; a killed rank stops the engine.
One cp=2 server start for the module (float32: cp merges partials by LSE, so logprobs differ
from cp=1's in their last bits, and tokens are compared)."""

from __future__ import annotations

import random
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import psutil
import pytest

from tests.integration.conftest import Server, start_server, stop_server, worker_procs

if TYPE_CHECKING:
    from engine.local import LocalEngine

ARGS = ("--cpu-threads", "1", "--dtype", "float32", "--max-prefill-tokens", "64", "--max-running-requests", "4",
        "--enable-hierarchical-cache", "--hicache-ratio", "2")
CP_POOL = 256  # tokens per rank: 16 usable pages of 16 each, 32 over both ranks
MAX_NEW = 6  # LONG[2]'s decode crosses a page (45 + 5 written tokens), so onto the next rank
FEW_NEW = 3  # where no decode crosses a page (CONVS: 150 + 2, LONG[:2]: 83 + 2, 150 + 2): a prefix of MAX_NEW's


def cp_prompts(seed: int, lo: int, hi: int) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """(long prompts of 6, 10 and 3 pages; 5 conversations of 10 pages, more than L1's 32 in all; a
    suffix behind 6 cached pages of the second long prompt), token ids in [lo, hi)."""
    rng = random.Random(seed)
    long = [[rng.randrange(lo, hi) for _ in range(n)] for n in (83, 150, 45)]
    convs = [[rng.randrange(lo, hi) for _ in range(150)] for _ in range(5)]
    return long, convs, long[1][:96] + [rng.randrange(lo, hi) for _ in range(37)]


LONG, CONVS, SUFFIX = cp_prompts(11, 200, 20000)
BEYOND = [random.Random(12).randrange(200, 20000) for _ in range(400)]  # 25 pages: more than one rank's 16


@pytest.fixture(scope="module")
def l3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("l3")


@pytest.fixture(scope="module")
def cp_server(tmp_path_factory: pytest.TempPathFactory, l3_dir: Path) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("cp-logs"), "--cp-size", "2", "--max-total-tokens", str(CP_POOL),
                       *ARGS, "--l3-dir", str(l3_dir))
    yield srv
    if srv.proc.poll() is None:
        stop_server(srv)


@pytest.fixture(scope="module")
def cp1(default_model_dir: Path) -> LocalEngine:
    from engine.config import ServerConfig
    from engine.local import LocalEngine

    return LocalEngine(ServerConfig(model=str(default_model_dir), device="cpu", dtype="float32", max_total_tokens=4096))


@pytest.fixture(scope="module")
def reference(cp1: LocalEngine) -> dict[tuple[int, ...], list[int]]:
    """cp=1 greedy tokens of every prompt, in this process."""
    from msgs.params import SamplingParams

    prompts = [*LONG, *CONVS, SUFFIX, BEYOND]
    res = cp1.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True))
    return {tuple(p): r.output_ids for p, r in zip(prompts, res, strict=True)}


def generate(srv: Server, ids: list[int], new: int = MAX_NEW) -> tuple[list[int], int]:
    """(greedy output ids, cached prompt tokens) of one /generate request."""
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}}
    r = httpx.post(f"{srv.http}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"], r.json()["meta_info"]["cached_tokens"]


def flush_after_l3_writes(srv: Server, writes: int) -> None:
    """Wait until L3 holds `writes` pages (written at commit, asynchronously), then empty L1 and
    L2 (/flush_cache: 409 while commits are in flight), so the next hits come from the files."""
    deadline = time.monotonic() + 30
    while srv.metrics()["strata_l3_writes_total"] < writes:
        assert time.monotonic() < deadline, "L3 files not written"
        time.sleep(0.2)
    while (r := httpx.post(f"{srv.http}/flush_cache", timeout=30)).status_code == 409:
        assert time.monotonic() < deadline, r.text
        time.sleep(0.2)
    assert r.status_code == 200


def test_cp2_batched_chunked_long_prompts_give_cp1_tokens(cp_server: Server, reference: dict) -> None:
    envs = {r: p.environ() for r, p in worker_procs(cp_server).items()}
    assert sorted(envs) == [0, 1] and {e["WORLD_SIZE"] for e in envs.values()} == {"2"}
    with ThreadPoolExecutor(3) as pool:  # together: one batch, prefilled in 64-token chunks, overlap on
        outs = list(pool.map(lambda ids: generate(cp_server, ids), LONG))
    assert [o for o, _ in outs] == [reference[tuple(p)] for p in LONG]
    got, cached = generate(cp_server, SUFFIX)  # behind the cached prefix of LONG[1] (split as it was)
    assert cached == 96 and got == reference[tuple(SUFFIX)]
    m = cp_server.wait_idle()
    used = [m[f'strata_kv_pages_used_by_cp_rank{{cp_rank="{r}"}}'] for r in (0, 1)]
    assert sum(used) == m["strata_kv_pages_used"] > 0 and abs(used[0] - used[1]) <= 3  # each about half
    assert m["strata_kv_pages_total"] == 2 * (CP_POOL // 16) and m["strata_kv_leak_free"] == 1


def scored(srv: Server, ids: list[int], new: int = FEW_NEW) -> dict:
    """/generate with prompt_logprobs 2: (output ids, [(logprob, id)] of the prompt after its first token,
    the top-2 ids of each)."""
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": new, "temperature": 0, "ignore_eos": True,
                                                  "prompt_logprobs": 2}}
    r = httpx.post(f"{srv.http}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    assert meta["input_token_logprobs"][0][0] is None and len(meta["input_token_logprobs"]) == len(ids)
    return {"ids": r.json()["output_ids"], "scores": [(v, t) for v, t, _ in meta["input_token_logprobs"][1:]],
            "top": [[t for _, t, _ in top] for top in meta["input_top_logprobs"][1:]]}


def test_cp2_prompt_logprobs_equal_cp1s(cp_server: Server, cp1: LocalEngine, reference: dict) -> None:
    """prompt_logprobs at cp=2 (a 400 once): every rank ends a layer with every row's hidden state, so
    the scored prompts, chunked (64 tokens) and batched beside an unscored one, score as at cp=1 (in
    float32, up to the last bits of the LSE merge)."""
    from msgs.params import SamplingParams

    with ThreadPoolExecutor(3) as pool:
        outs = list(pool.map(lambda ids: scored(cp_server, ids), LONG[:2]))
        plain = pool.submit(generate, cp_server, LONG[2], FEW_NEW)
    assert plain.result()[0] == reference[tuple(LONG[2])][:FEW_NEW]
    want = cp1.generate(LONG[:2], SamplingParams(max_new_tokens=FEW_NEW, temperature=0, ignore_eos=True,
                                                 prompt_logprobs=2))
    for got, ref, ids in zip(outs, want, LONG[:2], strict=True):
        assert got["ids"] == ref.output_ids == reference[tuple(ids)][:FEW_NEW]
        assert [t for _, t in got["scores"]] == ids[1:]
        assert max(abs(v - w) for (v, _), w in zip(got["scores"], ref.prompt_logprobs, strict=True)) < 1e-4
        assert got["top"] == [[t for t, _ in row] for row in ref.prompt_top_logprobs]
    assert cp_server.wait_idle()["strata_kv_leak_free"] == 1


def test_cp2_serves_a_context_longer_than_one_ranks_pool(cp_server: Server, reference: dict) -> None:
    """A request's pages round robin over the ranks, so its context may reach cp x one rank's pool
    (CP_POOL tokens): the engine admits it (max_model_len says so) and answers cp=1's tokens."""
    models = httpx.get(f"{cp_server.http}/v1/models", timeout=10).json()["data"]
    assert models[0]["max_model_len"] == 2 * CP_POOL
    got, _ = generate(cp_server, BEYOND)
    assert got == reference[tuple(BEYOND)]
    assert cp_server.wait_idle()["strata_kv_leak_free"] == 1


def test_cp2_shared_host_tier_l2_reload_and_l3(cp_server: Server, reference: dict, l3_dir: Path,
                                               tmp_path: Path) -> None:
    for c in CONVS:  # computed; later ones push the earlier out of L1
        assert generate(cp_server, c, FEW_NEW)[0] == reference[tuple(c)][:FEW_NEW]
    for c in CONVS[:4]:  # loaded back from the one slab both ranks share: each rank its own pages
        got, cached = generate(cp_server, c, FEW_NEW)
        assert got == reference[tuple(c)][:FEW_NEW] and cached >= 144
    m = cp_server.wait_idle()
    assert m['strata_cache_hit_tokens_total{tier="l2"}'] > 0 and m["strata_l2_load_backs_total"] > 0
    assert m["strata_l2_pages_total"] == 2 * m["strata_kv_pages_total"]  # --hicache-ratio 2 of both ranks' pools
    assert m["strata_kv_leak_free"] == 1
    flush_after_l3_writes(cp_server, 9 * 5)
    got, cached = generate(cp_server, CONVS[0], FEW_NEW)  # L1 and L2 empty: from the files
    assert got == reference[tuple(CONVS[0])][:FEW_NEW] and cached == 144
    # a cp=1 engine on the same directory serves what cp=2 wrote (the files do not depend on cp), one
    # of the same arithmetic: not deterministic, as cp=2 is by default (a deterministic engine's
    # fingerprint differs, engine/run/fingerprint.py: it must not serve another arithmetic's pages)
    one = start_server(tmp_path, "--max-total-tokens", str(2 * CP_POOL), *ARGS, "--l3-dir", str(l3_dir),
                       "--disable-deterministic-inference")
    try:
        got, cached = generate(one, CONVS[1], FEW_NEW)
        assert got == reference[tuple(CONVS[1])][:FEW_NEW] and cached == 144
        assert one.wait_idle()['strata_cache_hit_tokens_total{tier="l3"}'] == 144
    finally:
        assert stop_server(one) == 0


def test_tp2_cp2_on_four_workers_gives_cp1_tokens(reference: dict, tmp_path: Path) -> None:
    """tp x cp = 4 workers (rank = cp_rank * 2 + tp_rank): each tp pair splits the heads, each cp
    pair the pages."""
    srv = start_server(tmp_path, "--tp-size", "2", "--cp-size", "2", "--max-total-tokens", str(CP_POOL), *ARGS[:8])
    try:
        envs = {r: p.environ() for r, p in worker_procs(srv).items()}
        assert sorted(envs) == [0, 1, 2, 3] and {e["WORLD_SIZE"] for e in envs.values()} == {"4"}
        with ThreadPoolExecutor(2) as pool:  # two of the long prompts batched (4 CPU workers on 2 cores: few tokens)
            outs = list(pool.map(lambda ids: generate(srv, ids, FEW_NEW), LONG[:2]))
        assert [o for o, _ in outs] == [reference[tuple(p)][:FEW_NEW] for p in LONG[:2]]
        assert srv.wait_idle()["strata_kv_leak_free"] == 1
    finally:
        assert stop_server(srv) == 0


def test_cp2_deterministic_is_one_answer_whatever_the_cache_chunks_and_batch(tmp_path: Path) -> None:
    """--enable-deterministic-inference at cp=2: a prompt's greedy tokens and logprobs are the same
    bits fresh, behind a cached prefix (other chunks: 64-token prefill chunks from another start)
    and batched beside others: every row attends this rank's keys as a decode row of its own
    (cp_attention.plan_step's per_row). An audit found the answer moving with the cached prefix."""
    srv = start_server(tmp_path, "--cp-size", "2", "--max-total-tokens", str(CP_POOL), *ARGS[:8],
                       "--enable-deterministic-inference")

    def run(ids: list[int]) -> tuple[list[int], list]:
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0,
                                                      "ignore_eos": True, "logprobs": True}}
        r = httpx.post(f"{srv.http}/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["output_ids"], r.json()["meta_info"]["output_token_logprobs"]

    def flush() -> None:
        assert httpx.post(f"{srv.http}/flush_cache", timeout=30).status_code == 200

    try:
        assert httpx.get(f"{srv.http}/health").json()["deterministic"] is True
        suffix_fresh = run(SUFFIX)
        long_behind_suffix = run(LONG[1])  # its first 96 tokens cached by SUFFIX
        flush()
        long_fresh = run(LONG[1])
        suffix_behind_long = run(SUFFIX)
        flush()
        with ThreadPoolExecutor(3) as pool:  # one batch, chunks of 64 shared between the three
            batched = list(pool.map(run, LONG))
        assert long_fresh == long_behind_suffix == batched[1]
        assert suffix_fresh == suffix_behind_long
        alone = scored(srv, LONG[1])  # prompt scores: the same bits alone and beside others, in other chunks
        with ThreadPoolExecutor(3) as pool:
            beside = list(pool.map(lambda ids: scored(srv, ids), [LONG[0], LONG[1], LONG[2]]))
        assert alone == beside[1] and alone["ids"] == long_fresh[0][:FEW_NEW]
        assert srv.wait_idle()["strata_kv_leak_free"] == 1
    finally:
        assert stop_server(srv) == 0


def test_cp2_killed_rank_stops_engine(cp_server: Server) -> None:
    everyone = psutil.Process(cp_server.proc.pid).children(recursive=True)
    worker_procs(cp_server)[1].send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    assert cp_server.proc.wait(timeout=30) == 1
    assert time.monotonic() - t0 < 15, "the supervisor stops the engine within seconds"
    time.sleep(0.5)
    left = [p for p in everyone if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"orphans: {[p.cmdline() for p in left]}"
