"""bin/bench: each mode end to end as a subprocess on a tiny random-weight model, plus the
pure helpers. One server start per server mode; the whole file takes well under a minute."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from engine.bench import cli, idle, online, report, roofline, workload

ROOT = Path(__file__).resolve().parents[2]
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 64,
    "intermediate_size": 128,
    "max_position_embeddings": 1024,
    "model_type": "llama",
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "vocab_size": 512,
}
WORKLOAD = ["--num-requests", "8", "--input-len-range", "16", "64", "--output-len-range", "8", "32"]
SERVER = ["--load-format", "dummy", "--server-args", "--max-total-tokens 4096"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama config with no tokenizer files: the server runs in ids-only mode."""
    path = tmp_path_factory.mktemp("tiny-llama")
    (path / "config.json").write_text(json.dumps(TINY_LLAMA))
    return path


def run_bench(argv: list[str], timeout: int = 180) -> str:
    """bin/bench `argv`; its stdout, after asserting exit 0. On a timeout the whole process group
    goes (bin/bench and the server it started: a killed bench alone left its server running)."""
    proc = subprocess.Popen([str(ROOT / "bin" / "bench"), *argv], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"bin/bench timed out:\n{stdout[-3000:]}{stderr[-3000:]}")
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    return stdout


def bench(out: Path, *args: str) -> dict[str, Any]:
    """Run bin/bench with `args`, writing to `out`; return the JSON record."""
    stdout = run_bench([*args, "--out", str(out)])
    assert "settings" in stdout and "result written to" in stdout
    return json.loads(out.read_text())


def check_record(rec: dict[str, Any], mode: str) -> None:
    assert rec["mode"] == mode and rec["model"].startswith("tiny-llama")
    assert rec["date"] and rec["command"].startswith(f"bin/bench {mode}")
    assert rec["hardware"]["cpu"] and rec["hardware"]["torch"]
    assert "gpu" in rec["hardware"] and "git_commit" in rec


def check_throughput(f: dict[str, Any]) -> None:
    assert f["completed"] == f["num_requests"] == 8 and f["failed"] == 0
    assert f["output_len_mismatch"] == 0, f
    assert f["total_input_tokens"] > 0 and f["total_output_tokens"] >= 8 * 8
    for key in ("duration_s", "request_throughput", "input_throughput", "output_throughput"):
        assert f[key] > 0 and math.isfinite(f[key]), key


def test_offline_sdk(tiny_model: Path, tmp_path: Path) -> None:
    rec = bench(tmp_path / "off.json", "offline", "--model", str(tiny_model), *SERVER, *WORKLOAD)
    check_record(rec, "offline")
    assert rec["settings"]["backend_used"] == "sdk" and rec["settings"]["num_requests"] == 8
    check_throughput(rec["figures"])
    # the hardware probe (~2 s of CPU) finished before the timed load began, never inside it
    assert rec["hardware"]["probed_at"] <= rec["settings"]["load_started_at"]


def test_serve_generate_stream(tiny_model: Path, tmp_path: Path) -> None:
    rec = bench(
        tmp_path / "serve.json", "serve", "--model", str(tiny_model), *SERVER, *WORKLOAD,
        "--request-rate", "40", "--max-concurrency", "4",
    )
    check_record(rec, "serve")
    f = rec["figures"]
    check_throughput(f)
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_latency_ms"):
        stats = f[key]
        assert 0 < stats["mean"] and stats["median"] <= stats["p90"] <= stats["p99"] <= stats["max"], key
    assert f["e2e_latency_ms"]["mean"] >= f["ttft_ms"]["mean"]


def test_latency_vs_roofline(tiny_model: Path, tmp_path: Path) -> None:
    rec = bench(
        tmp_path / "lat.json", "latency", "--model", str(tiny_model), "--load-format", "dummy", "--device", "cpu",
        "--batch-sizes", "1", "3", "--context-len", "40", "--steps", "4", "--warmup", "2", "--profile-idle",
        "--temperature", "0.8", "--top-k", "5", "--top-p", "0.9",  # sampled steps (the race), not an argmax
        "--server-args", "--dtype float32",  # the KV bytes below are float32's (auto may be bf16 on this CPU)
    )
    check_record(rec, "latency")
    assert rec["settings"]["temperature"] == 0.8
    assert rec["settings"]["top_k"] == 5 and rec["settings"]["top_p"] == 0.9
    f = rec["figures"]
    assert f["device"] == "cpu" and f["bandwidth_gb_s"] > 0 and f["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4
    assert f["compiled_after_ready"] == [] and f["startup_s"]["warmup_s"] >= 0 and f["startup_s"]["load_s"] > 0
    assert [b["batch_size"] for b in f["batches"]] == [1, 3]
    for b in f["batches"]:
        assert b["ms_per_step_median"] > 0 and b["roofline_ms"] > 0 and b["ratio_to_roofline"] > 0
        assert b["tokens_per_s"] > 0 and b["bytes_per_step"] == b["weight_bytes"] + b["kv_bytes_read"]
        assert 40 < b["mean_kv_tokens_per_row"] < 40 + 2 + 4 + 2
        assert b["pipelined_ms_per_step"] > 0 and b["pipelined_ms_per_step_mean"] > 0  # median and mean
        assert "skipped" in b["idle"]  # no GPU here


def test_latency_prefills_a_large_batch_in_chunks(tiny_model: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Past PREFILL_CAP prompt tokens the batch is prefilled in chunks (rows done first decode
    meanwhile, within the budget), and the timed steps are still whole-batch decodes."""
    from types import SimpleNamespace

    from engine.bench import latency

    monkeypatch.setattr(latency, "PREFILL_CAP", 48)  # 3 x 40 prompt tokens: 3 prefill steps
    server_args = "--dtype float32 --max-prefill-tokens 16"
    args = SimpleNamespace(server_args=server_args, batch_sizes=[3], context_len=40, load_format="dummy",
                           device="cpu", warmup=1, steps=3, idle_steps=20, profile_idle=False)
    assert latency.server_config(args, str(tiny_model)).max_prefill_tokens == 48
    assert latency.decode_budget(args) == 2 * 1 + 2 * 3 + 6 + 3
    out = tmp_path / "lat.json"
    assert cli.main(["latency", "--model", str(tiny_model), "--load-format", "dummy", "--device", "cpu",
                     "--batch-sizes", "3", "--context-len", "40", "--steps", "3", "--warmup", "1",
                     "--server-args", server_args, "--out", str(out)]) == 0
    (b,) = json.loads(out.read_text())["figures"]["batches"]
    assert b["batch_size"] == 3 and b["ms_per_step_median"] > 0
    assert 40 < b["mean_kv_tokens_per_row"] < 40 + 3 + 2 * 4 + 2  # the early rows' tokens during the chunks


# -- helpers ------------------------------------------------------------------------------


def test_weight_bytes_skip_untied_embedding() -> None:
    import torch

    from models.registry import load_model

    model, cfg = load_model(ROOT / "configs" / "tiny-llama", "dummy", torch.float32, "cpu", progress=False)
    total = sum(p.nbytes for p in model.parameters())
    embed = cfg.vocab_size * cfg.hidden_size * 4
    assert roofline.weight_bytes(model, tied_embeddings=False) == total - embed
    tied, tcfg = load_model(ROOT / "configs" / "tiny-qwen3", "dummy", torch.float32, "cpu", progress=False)
    assert tcfg.tie_word_embeddings
    assert roofline.weight_bytes(tied, True) == sum(p.nbytes for p in tied.parameters())


def test_random_requests_seeded() -> None:
    a = workload.random_requests(5, (3, 9), (2, 4), 100, seed=7)
    assert a == workload.random_requests(5, (3, 9), (2, 4), 100, seed=7)
    assert a != workload.random_requests(5, (3, 9), (2, 4), 100, seed=8)
    assert all(3 <= len(r.prompt) <= 9 and 2 <= r.output_len <= 4 for r in a)
    assert all(0 <= t < 100 for r in a for t in r.prompt)
    fixed = workload.random_requests(3, (3, 9), (2, 4), 100, seed=0, input_len=5, output_len=6)
    assert {(len(r.prompt), r.output_len) for r in fixed} == {(5, 6)}


def test_summary_and_idle_math() -> None:
    s = report.summary([1.0, 2.0, 3.0, 4.0], scale=1000)
    assert s["mean"] == 2500 and s["median"] == 2500 and s["max"] == 4000
    assert report.summary([])["mean"] is None
    assert idle.union_length([(0, 5), (3, 8), (10, 12)]) == 10
    st = idle.idle_stats([(0, 60), (100, 160)], steps=2, host_s=0.0, sched_s=20e-9)
    assert st["idle_fraction"] == pytest.approx(40 / 160)
    assert st["worker_idle_fraction"] == pytest.approx(20 / 140)


def test_arrivals_and_arg_checks() -> None:
    assert online.arrival_gaps(4, math.inf, 0) == [0.0] * 4
    gaps = online.arrival_gaps(2000, 10.0, 0)
    assert sum(gaps) / len(gaps) == pytest.approx(0.1, rel=0.1)
    assert cli.main(["offline", "--input-len-range", "10", "5"]) == 2
    assert cli.main(["latency", "--warmup", "0"]) == 2
    assert cli.main(["spec", "--algorithm", "STANDALONE"]) == 2  # needs --draft-model
    assert cli.main(["spec", "--draft-model", "x"]) == 2  # goes with STANDALONE
    assert cli.main(["spec", "--algorithm", "NEXTN", "--corrupt", "0.5"]) == 2  # corrupts NGRAM's drafts only
    # an audit: 0 read as "unset" ran a bench of 0-token outputs (and 0-token prompts, all 400s)
    assert cli.main(["offline", "--output-len", "0"]) == 2 and cli.main(["serve", "--input-len", "0"]) == 2
    # one bin/serve flag as --server-args' value: argparse alone reads it as an unknown bin/bench option
    args = cli.build_parser().parse_args(cli._glued(["latency", "--server-args", "--enable-deterministic-inference"]))
    assert args.server_args == "--enable-deterministic-inference"


def test_a_server_with_an_api_key_is_benched_with_it(tiny_model: Path, tmp_path: Path) -> None:
    """An audit: bin/bench had no way to send a key (every request a 401); --api-key goes to the
    server it starts and with every request (SDK and HTTP), and stays out of the result file."""
    for backend in ("offline", "serve"):
        out = tmp_path / f"{backend}.json"
        run_bench([backend, "--model", str(tiny_model), "--load-format", "dummy", "--num-requests", "3",
                   "--input-len", "8", "--output-len", "4", "--api-key", "sekrit",
                   "--server-args", "--max-total-tokens 8192", "--out", str(out)])
        rec = json.loads(out.read_text())
        assert rec["figures"]["completed"] == 3 and "sekrit" not in out.read_text(), rec


def test_the_sdk_bench_client_tells_a_silent_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """An audit: bin/bench offline --sdk at an address with no server waited forever (0/4); it is the
    SDK's 503 once nothing was heard for SILENCE_S (shortened here)."""
    import asyncio

    from engine.bench import sdk_client
    from engine.supervise import free_ports
    from msgs.sdk import StrataError

    monkeypatch.setattr(sdk_client, "SILENCE_S", 1.5)

    async def one() -> None:
        async with sdk_client.SdkBatchClient(f"tcp://127.0.0.1:{free_ports(1)[0]}") as client:
            await client.generate([1, 2], max_new_tokens=2)

    with pytest.raises(StrataError) as err:
        asyncio.run(one())
    assert err.value.status == 503


def test_sigterm_stops_the_server_the_bench_started(tiny_model: Path) -> None:
    """An audit: a SIGTERM to bin/bench skipped the `finally` that stops its server, left running."""
    import psutil

    proc = subprocess.Popen([str(ROOT / "bin" / "bench"), "offline", "--model", str(tiny_model), "--load-format",
                             "dummy", "--num-requests", "2", "--input-len", "8", "--output-len", "1000",
                             "--server-args=--max-total-tokens 8192"],
                            cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        lines = []
        while not any("server ready" in line for line in lines):
            line = proc.stdout.readline()
            assert line, "".join(lines)
            lines.append(line)
        port = next(line for line in lines if line.startswith("starting:")).split("--port ")[1].split()[0]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
        left = [p for p in psutil.process_iter(["cmdline"]) if f"--port {port}" in " ".join(p.info["cmdline"] or [])]
        assert not left, left
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_generate_event_token_count() -> None:
    event = json.dumps({
        "text": '"completion_tokens": 99', "output_ids": [5, 6],
        "meta_info": {"id": "x", "prompt_tokens": 4, "completion_tokens": 2, "finish_reason": None},
    })
    assert online.completion_tokens(event) == 2


def test_deterministic_modes_count_one_answer(tiny_model: Path, tmp_path: Path) -> None:
    """bin/bench deterministic (SGLang's single/mixed/prefix tests) with the mode on: one answer
    per prompt, and the record says so (exit 0); its own logic is what fails it otherwise. The
    prompts under test filter (top_k / top_p) beside neighbours that filter otherwise."""
    out = tmp_path / "det.json"
    run_bench(["deterministic", "--model", str(tiny_model), "--load-format", "dummy", "--samples", "12",
               "--max-batch", "4", "--max-new", "3", "--sampling", "filtered",
               "--server-args", "--max-total-tokens 8192 --enable-deterministic-inference", "--out", str(out)],
              timeout=300)
    rec = json.loads(out.read_text())
    assert rec["deterministic"] is True and rec["health"]["deterministic"] is True and rec["sampling"] == "filtered"
    assert rec["single"] == {"prompt0": 1} and len(rec["prefix"]) == 4 and set(rec["mixed"].values()) == {1}


def test_structured_counts_stop_answers_that_are_not_valid() -> None:
    """bin/bench structured's check (issue 27): an answer that finished with "stop" and fails
    json.loads or the schema is counted (the bench then exits 1); a "length" one is not."""
    from engine.bench.structured import _validity

    item = {"id": 1, "name": "abcd", "kind": "beta", "ok": True}
    good = json.dumps({"items": [item] * 8})
    short = json.dumps({"items": [item]})  # JSON, but minItems is 8

    def out(text: str, reason: str) -> dict[str, Any]:
        return {"text": text, "meta_info": {"finish_reason": {"type": reason}}}

    outs = [out(good, "stop"), out('{"items": [{"name": "a\\x08', "length"), out(short, "stop"),
            out(good[:-2] + '\x08"}', "stop")]
    assert _validity(outs) == (1, 2)


def test_spec_oracle_accepts_every_draft_and_answers_as_plain(tiny_model: Path, tmp_path: Path) -> None:
    """bin/bench spec: the second answer of a cached prompt drafts the target's own greedy
    continuation from the prefix cache (float32: logits agree bit for bit), so every draft is
    accepted (only the last rows, short of room, verify fewer), and the answers are plain decoding's."""
    rec = bench(tmp_path / "spec.json", "spec", "--model", str(tiny_model), "--load-format", "dummy",
                "--drafts", "3", "--output-len", "21", "--prompt-len", "24",
                "--server-args", "--max-total-tokens 4096 --dtype float32")
    check_record(rec, "spec")
    plain, spec = rec["figures"]["results"]
    assert plain["k"] == 0 and plain["accept_length"] is None and plain["repeat_equal"]
    assert spec["k"] == 3 and spec["equal_to_plain"] and spec["repeat_equal"]
    assert spec["accept_length"] == 4.0  # 20 tokens after the first: 5 rows of 3 drafts + a bonus
    assert spec["tok_s"] > 0 and spec["speedup"] > 0
    assert plain["steps"] == 21  # a step a token, and the step overlap planned before the last answer
    assert spec["steps"] == 6  # the 5 verify rows (the oracle covers the whole answer) and overlap's one
    assert spec["rows_without_drafts"] == 0 == plain["rows_without_drafts"]
    ratio = spec["tokens_per_step"] / plain["tokens_per_step"]
    assert spec["step_cost"] * spec["speedup"] == pytest.approx(ratio)  # step time / plain step's


def test_spec_standalone_draft_model_is_the_target_itself(tiny_model: Path, tmp_path: Path) -> None:
    """bin/bench spec --algorithm STANDALONE --draft-model: the target's own directory with
    --load-format dummy is a draft with the target's weights (the same seed), so in float32 every
    draft is accepted and the answers are plain decoding's."""
    rec = bench(tmp_path / "spec.json", "spec", "--model", str(tiny_model), "--load-format", "dummy",
                "--algorithm", "STANDALONE", "--draft-model", str(tiny_model), "--drafts", "3",
                "--output-len", "21", "--prompt-len", "24", "--server-args", "--max-total-tokens 4096 --dtype float32")
    check_record(rec, "spec")
    assert rec["figures"]["algorithm"] == "STANDALONE"
    plain, spec = rec["figures"]["results"]
    assert spec["k"] == 3 and spec["equal_to_plain"] and spec["repeat_equal"]
    assert spec["accept_length"] > 3.5, spec  # at most 4 (3 drafts + the bonus)



def test_report_compiles_lists_what_the_kernel_caches_gained(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """The benchmarks' "compiled after ready" line: files the triton, flashinfer and inductor caches
    gained since the snapshot, and none where nothing was written."""
    from engine.bench import launch

    for var, sub in (("TRITON_CACHE_DIR", "triton"), ("FLASHINFER_WORKSPACE_BASE", "fi"),
                     ("TORCHINDUCTOR_CACHE_DIR", "inductor")):
        monkeypatch.setenv(var, str(tmp_path / sub))
    (tmp_path / "triton" / "old").mkdir(parents=True)
    (tmp_path / "triton" / "old" / "k.cubin").write_bytes(b"x")
    at_ready = launch.cached_kernels()
    assert launch.report_compiles(at_ready) == []
    new = [tmp_path / "triton" / "new" / "k.cubin", tmp_path / "fi" / ".cache" / "flashinfer" / "m.so",
           tmp_path / "inductor" / "g.py"]
    for f in new:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(b"x")
    assert launch.report_compiles(at_ready) == sorted(map(str, new))
    assert "compiled after ready: 3 new kernel-cache files" in capsys.readouterr().out
