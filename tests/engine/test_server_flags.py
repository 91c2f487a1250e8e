"""Start-up flags that once got through: each now fails at start with one message naming it (and
bin/serve exits 2, with no traceback), before any process or weight is loaded."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from engine.config import MAX_RUNNING_REQUESTS, ServerConfig
from tests.ports import reserve_ports

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny-llama"


@pytest.mark.parametrize(("kw", "message"), [
    ({"max_running_requests": 0}, "--max-running-requests must be in 1"),
    ({"max_running_requests": MAX_RUNNING_REQUESTS + 1}, "--max-running-requests must be in 1"),
    ({"context_length": -5}, "bad --context-length -5"),
    ({"watchdog_timeout": 0}, "bad --watchdog-timeout"),
    ({"attention_backend": "foo"}, "bad --attention-backend 'foo'"),
    ({"max_total_tokens": 1}, "--max-total-tokens 1 holds no KV page of 16"),
    ({"context_length": 1}, "bad --context-length 1"),
    ({"watchdog_timeout": 1e-9}, "bad --watchdog-timeout"),
    ({"watchdog_timeout": float("inf")}, "--watchdog-timeout must be a finite number"),
    ({"hicache_ratio": float("inf")}, "--hicache-ratio must be a finite number"),
    ({"cpu_threads": 10**6}, "--cpu-threads must be in 0.."),
    ({"port": 70000}, "bad --port 70000"),
    ({"host": ""}, "--host must name an address"),
    ({"sdk_port": 0}, "bad --sdk-port 0"),
    ({"dtype": "int8"}, r"bad --dtype int8 \(auto, float32, bfloat16, float16\)"),
    ({"chat_template": "/"}, "--chat-template /: a directory, not a file"),
])
def test_bad_values_are_refused(kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ServerConfig(**kw)


def test_context_length_beyond_the_models_positions_is_refused() -> None:
    most = json.loads((TINY / "config.json").read_text())["max_position_embeddings"]
    assert ServerConfig(model=str(TINY), context_length=most).context_length == most
    with pytest.raises(ValueError, match=f"exceeds the model's max_position_embeddings \\({most}\\)"):
        ServerConfig(model=str(TINY), context_length=most + 1)


def test_a_check_against_the_default_model_exits_2_without_a_traceback() -> None:
    """The default model is filled in after the flags are parsed; its checks still end in exit 2."""
    run = subprocess.run([str(ROOT / "bin" / "serve"), "--speculative-algorithm", "NEXTN"], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2, run.stderr[-2000:]
    assert "has no MTP layer" in run.stderr and "Traceback" not in run.stderr


def test_a_broken_config_json_is_named(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json: not a readable JSON file"):
        ServerConfig(model=str(tmp_path), context_length=100)


@pytest.mark.parametrize(("args", "says"), [
    (["--log-dir", "/proc/strata-no-such-dir"], "--log-dir /proc/strata-no-such-dir"),
    (["--model", "/"], "no config.json there"),
    # the default model (9 heads, 3 K/V heads): checked before any worker starts
    (["--tp-size", "4"], "--tp-size 4: the model has 9 attention heads and 3 K/V heads"),
    (["--enable-hierarchical-cache", "--l3-dir", "/proc/strata-l3"], "--l3-dir /proc/strata-l3: cannot create it"),
    # no abbreviations (`--tp` once matched --tp-size by prefix; it is SGLang's name now, engine/args.py ALIASES)
    (["--max-running", "2"], "unrecognized arguments: --max-running 2"),
    (["--log-dir", "/dev/null"], "--log-dir /dev/null: a file is in the way of the directory"),
])
def test_bad_paths_exit_2(args: list[str], says: str) -> None:
    run = subprocess.run([str(ROOT / "bin" / "serve"), *args], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and says in run.stderr and "Traceback" not in run.stderr, run.stderr[-2000:]


@pytest.mark.parametrize("case", ["digest_every", "log_json", "cache_dir_a_file", "config_a_list", "heads_0",
                                  "heads_a_string"])
def test_bad_environment_and_model_configs_exit_2(tmp_path: Path, case: str) -> None:
    """A bad STRATA_* variable (with --api-key, which once skipped reading them before logging set
    up), a cache dir that is a file, and a config.json that is not an object or has a size that
    is not a positive integer: exit 2 naming it, before any process starts, no traceback."""
    import os

    env, args = {**os.environ}, ["--port", "1", "--sdk-port", "2"]  # never bound: refused before any start
    config = json.loads((TINY / "config.json").read_text())
    model = tmp_path / "model"
    model.mkdir()
    if case == "digest_every":
        env["STRATA_DIGEST_EVERY"], args, says = "abc", [*args, "--api-key", "k"], "STRATA_DIGEST_EVERY must be"
    elif case == "log_json":
        env["STRATA_LOG_JSON"], says = "maybe", "STRATA_LOG_JSON must be"
    elif case == "cache_dir_a_file":
        (tmp_path / "file").write_text("")
        env["STRATA_CACHE_DIR"], says = str(tmp_path / "file"), "cannot be prepared under STRATA_CACHE_DIR"
    else:
        body: object = [1, 2] if case == "config_a_list" else {**config, "num_attention_heads": 0 if case == "heads_0"
                                                                   else "4"}
        (model / "config.json").write_text(json.dumps(body))
        args = [*args, "--model", str(model), "--load-format", "dummy"]
        says = "a JSON object expected" if case == "config_a_list" else "num_attention_heads must be a positive integer"
    run = subprocess.run([str(ROOT / "bin" / "serve"), *args], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 2 and says in run.stderr and "Traceback" not in run.stderr, run.stderr[-2000:]


def test_a_failed_bind_says_what_to_check() -> None:
    """The HTTP listener's bind error hints at the port when it is taken, at --host when this
    machine has no such address (not at the port, as it once did)."""
    import socket

    from procs.tokenizer import StartupError, listen_socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(StartupError, match="is the port in use"):
            listen_socket("127.0.0.1", taken.getsockname()[1])
    with pytest.raises(StartupError, match="--host is not an address of this machine"):
        listen_socket("192.0.2.1", 0)  # TEST-NET-1: never a local address


def test_device_cuda_without_cuda_names_the_flag() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    port = reserve_ports(2)
    sdk_port = port + 1
    run = subprocess.run([str(ROOT / "bin" / "serve"), "--device", "cuda", "--port", str(port), "--sdk-port",
                          str(sdk_port)], capture_output=True, text=True, timeout=120)
    # before any process starts (an audit: exit 1 from the worker after ~3 s)
    assert run.returncode == 2 and "--device cuda: this torch sees no CUDA device" in run.stderr, run.stderr[-2000:]
    run = subprocess.run([str(ROOT / "bin" / "serve"), "--attention-backend", "flashinfer", "--port", str(port),
                          "--sdk-port", str(sdk_port)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "--attention-backend flashinfer: this torch sees no CUDA" in run.stderr, \
        run.stderr[-2000:]


def test_the_ready_line_gives_the_context_and_warns_when_it_is_small() -> None:
    """A pool or --context-length that leaves requests a few dozen tokens starts, but says so (every
    longer request is a 400 after that)."""
    from msgs.control import Ready
    from procs.supervisor import ready_line

    def line(context: int) -> str:
        ready = {"tokenizer": Ready(proc="tokenizer", info={"http": "h", "sdk": "s"}),
                 "scheduler": Ready(proc="scheduler", info={"pages": "4", "max_context": str(context)})}
        return ready_line(ServerConfig(), ready)

    assert line(8192).endswith("; context 8192 tokens") and "warning" not in line(8192)
    assert "strata: warning: requests are limited to 64 tokens" in line(64)


def test_checks_before_start_read_the_model_and_make_the_l3_dir(tmp_path: Path) -> None:
    from engine.config import check_before_start

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"num_attention_heads": 9, "num_key_value_heads": 3}))
    for tp in (1, 2, 3):  # K/V heads split over the ranks (unevenly at 2)
        check_before_start(ServerConfig(model=str(tmp_path / "m"), tp_size=tp))
    with pytest.raises(ValueError, match="--tp-size 6: the model has 9 attention heads"):
        check_before_start(ServerConfig(model=str(tmp_path / "m"), tp_size=6))
    # the host tier's pages are one size on every rank: K/V heads split 2 + 1 cannot take it (it failed
    # after every worker had loaded, with a dump of the ranks' records), 3 + 3 or one each can
    with pytest.raises(ValueError, match="--enable-hierarchical-cache with --tp-size 2: the model's 3 K/V heads "
                                         "split 2 \\+ 1"):
        check_before_start(ServerConfig(model=str(tmp_path / "m"), tp_size=2, enable_hierarchical_cache=True))
    for tp in (1, 3):
        check_before_start(ServerConfig(model=str(tmp_path / "m"), tp_size=tp, enable_hierarchical_cache=True))
    l3 = tmp_path / "a" / "b" / "l3"
    check_before_start(ServerConfig(model=str(tmp_path / "m"), enable_hierarchical_cache=True, l3_dir=str(l3)))
    assert l3.is_dir()
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="--l3-dir .*: cannot create it"):
        check_before_start(ServerConfig(model=str(tmp_path / "m"), enable_hierarchical_cache=True,
                                        l3_dir=str(tmp_path / "file" / "l3")))


def test_checks_before_start_refuse_deterministic_cp_where_it_is_not_built(tmp_path: Path) -> None:
    """An audit: --cp-size 2 --enable-deterministic-inference --kv-cache-dtype fp8_e4m3 exited 1 from a
    worker after every process had started; it is the supervisor's exit 2 now."""
    from engine.config import check_before_start

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"num_attention_heads": 4, "num_key_value_heads": 2}))
    m = str(tmp_path / "m")
    check_before_start(ServerConfig(model=m, cp_size=2, enable_deterministic_inference=True, device="cpu"))
    check_before_start(ServerConfig(model=m, cp_size=2, kv_cache_dtype="fp8_e4m3", device="cpu"))  # mode off
    with pytest.raises(ValueError, match="--cp-size 2 with --enable-deterministic-inference: its invariant"):
        check_before_start(ServerConfig(model=m, cp_size=2, enable_deterministic_inference=True, device="cpu",
                                        kv_cache_dtype="fp8_e4m3"))
    (tmp_path / "m" / "config.json").write_text(json.dumps({"num_attention_heads": 4, "kv_lora_rank": 64}))
    with pytest.raises(ValueError, match="MLA's batch-invariant attention under context parallelism"):
        check_before_start(ServerConfig(model=m, cp_size=2, enable_deterministic_inference=True, device="cpu"))


def test_checks_before_start_refuse_a_standalone_draft_the_model_cannot_give(tmp_path: Path) -> None:
    """A self-draft of as many layers as the model, or a draft model directory without a config.json,
    fails before any process starts (it used to exit 1 from the worker ~3 s later)."""
    from engine.config import check_before_start

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"num_attention_heads": 9, "num_hidden_layers": 30}))
    m = str(tmp_path / "m")
    check_before_start(ServerConfig(model=m, speculative_algorithm="STANDALONE", speculative_draft_layers=29))
    for n in (30, 31):
        with pytest.raises(ValueError, match=f"--speculative-draft-layers {n}: must be in 1..29"):
            check_before_start(ServerConfig(model=m, speculative_algorithm="STANDALONE", speculative_draft_layers=n))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="--speculative-draft-model-path .*empty: no config.json"):
        check_before_start(ServerConfig(model=m, speculative_algorithm="STANDALONE",
                                        speculative_draft_model_path=str(tmp_path / "empty")))
    with pytest.raises(ValueError, match="--speculative-draft-model-path .*m: no safetensors weights there"):
        check_before_start(ServerConfig(model=m, speculative_algorithm="STANDALONE", speculative_draft_model_path=m))
    (tmp_path / "m" / "model.safetensors").write_bytes(b"")
    check_before_start(ServerConfig(model=m, speculative_algorithm="STANDALONE", speculative_draft_model_path=m))
    # an audit: a draft of another vocabulary failed in the worker after the model had loaded (exit 1)
    (tmp_path / "m" / "config.json").write_text(json.dumps({"num_hidden_layers": 30, "vocab_size": 49152}))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "vocab_size": 1000}))
    with pytest.raises(ValueError, match="d: its vocabulary has 1000 tokens, the model's 49152"):
        check_before_start(ServerConfig(model=m, speculative_algorithm="STANDALONE",
                                        speculative_draft_model_path=str(tmp_path / "d"), load_format="dummy"))


def test_checks_before_start_compile_the_chat_template(tmp_path: Path) -> None:
    """An audit: a --chat-template that does not compile (or is not UTF-8) exited 1 from the tokenizer
    after the weights had loaded, and an empty one started a server whose every chat was a 400."""
    from engine.config import check_before_start

    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 9}))
    for text, why in ((b"{% for m in messages %}{{ m.content }", "does not compile: unexpected '}'"),
                      (b"\xff\xfe{{ x }}", "not a readable UTF-8 file"), (b" \n", "the file is empty")):
        (tmp_path / "t.jinja").write_bytes(text)
        with pytest.raises(ValueError, match=f"--chat-template .*t.jinja.*{why}"):
            check_before_start(ServerConfig(model=str(tmp_path), chat_template=str(tmp_path / "t.jinja")))
    (tmp_path / "t.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    check_before_start(ServerConfig(model=str(tmp_path), chat_template=str(tmp_path / "t.jinja")))
