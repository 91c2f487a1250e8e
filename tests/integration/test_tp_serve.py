"""bin/serve --tp-size 2 on CPU (gloo): two worker processes with torch.distributed's
environment, greedy output equal to tp=1's, and a killed rank stops the whole engine
cleanly (exit 1 naming it, no process left behind, none hung in a collective).
One server start for the module."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from tests.integration.conftest import Server, start_server, worker_procs

PROMPTS = [[504, 3575, 282, 4649, 314], list(range(100, 160))]  # the second is chunked (budget 32)


@pytest.fixture(scope="module")
def tp_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("tp-logs"), "--tp-size", "2", "--cpu-threads", "1",
                       "--max-total-tokens", "4096", "--max-prefill-tokens", "32", "--dtype", "float32",
                       "--enable-deterministic-inference")
    yield srv
    if srv.proc.poll() is None:
        srv.proc.kill()
        srv.proc.wait()


def _reference(default_model_dir: Path) -> tuple[list[list[int]], list[float]]:
    """tp=1 greedy tokens of the same prompts, and the chunked prompt's logprobs, in this process."""
    from engine.config import ServerConfig
    from engine.local import LocalEngine
    from msgs.params import SamplingParams

    eng = LocalEngine(ServerConfig(model=str(default_model_dir), device="cpu", dtype="float32", max_total_tokens=4096))
    res = eng.generate(PROMPTS, SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True))
    scored = eng.generate(PROMPTS[1:], SamplingParams(max_new_tokens=1, temperature=0.0, prompt_logprobs=0))[0]
    assert scored.prompt_logprobs is not None
    return [r.output_ids for r in res], scored.prompt_logprobs


def test_tp2_serves_tp1_tokens(tp_server: Server, default_model_dir: Path) -> None:
    workers = worker_procs(tp_server)
    assert sorted(workers) == [0, 1]
    envs = {r: p.environ() for r, p in workers.items()}
    assert {envs[r]["RANK"] for r in envs} == {"0", "1"} and {e["WORLD_SIZE"] for e in envs.values()} == {"2"}
    assert len({e["MASTER_PORT"] for e in envs.values()}) == 1
    assert all(e["NCCL_NVLS_ENABLE"] == "0" and e["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1" for e in envs.values())
    got = []
    for ids in PROMPTS * 2:  # the second round hits the prefix cache
        r = httpx.post(f"{tp_server.http}/generate", timeout=120, json={
            "input_ids": ids, "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}})
        assert r.status_code == 200, r.text
        got.append(r.json()["output_ids"])
    scored = httpx.post(f"{tp_server.http}/generate", timeout=120, json={  # prompt_logprobs at tp=2, chunked
        "input_ids": PROMPTS[1], "sampling_params": {"max_new_tokens": 1, "temperature": 0, "prompt_logprobs": 0}})
    assert scored.status_code == 200, scored.text
    want, want_scores = _reference(default_model_dir)
    assert got == want * 2
    tp_scores = [v for v, _, _ in scored.json()["meta_info"]["input_token_logprobs"][1:]]
    assert max(abs(a - b) for a, b in zip(tp_scores, want_scores, strict=True)) < 1e-4
    assert tp_server.wait_idle()["strata_kv_leak_free"] == 1


def test_tp2_is_deterministic(tp_server: Server) -> None:
    """Deterministic inference at tp=2: a prompt's tokens and logprobs are
    the same bits alone, behind its cached prefix and batched with other requests."""
    from concurrent.futures import ThreadPoolExecutor

    prompt = list(range(1000, 1075))

    def gen(ids: list[int]) -> list:
        r = httpx.post(f"{tp_server.http}/generate", timeout=120, json={"input_ids": ids, "sampling_params": {
            "max_new_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": True}})
        assert r.status_code == 200, r.text
        return r.json()["meta_info"]["output_token_logprobs"]

    assert httpx.get(f"{tp_server.http}/health").json() == {"status": "ok", "deterministic": True}
    alone = gen(prompt)
    assert gen(prompt) == alone  # 64 of its tokens from the prefix cache
    others = [[(7 * i + k) % 3000 + 200 for k in range(n)] for i, n in enumerate((3, 40, 97, 16, 1))]
    with ThreadPoolExecutor(6) as pool:
        batched = list(pool.map(gen, [*others[:3], prompt[:40] + [9] + prompt[40:], prompt, *others[3:]]))
    assert batched[4] == alone


def test_killed_rank_stops_engine(tp_server: Server) -> None:
    everyone = psutil.Process(tp_server.proc.pid).children(recursive=True)
    workers = worker_procs(tp_server)
    workers[1].send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    assert tp_server.proc.wait(timeout=30) == 1
    assert time.monotonic() - t0 < 15, "the supervisor stops the engine within seconds"
    time.sleep(0.5)
    left = [p for p in everyone if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"orphans: {[p.cmdline() for p in left]}"
    lines = [json.loads(x) for x in (tp_server.log_dir / "supervisor.log").read_text().splitlines()]
    died = [rec for rec in lines if rec.get("event") == "child died"]
    assert [(rec["child"], "SIGKILL" in rec["reason"]) for rec in died] == [("worker-1", True)], died
