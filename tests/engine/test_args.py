"""bin/serve flags: every one explained, with its default."""

from __future__ import annotations

import dataclasses

import pytest

from engine.args import HELP, HIDDEN, build_parser
from engine.config import ServerConfig
from engine.supervise import free_ports


def test_every_flag_has_help_and_shows_its_default() -> None:
    parser = build_parser()
    text = parser.format_help()
    fields = [f for f in dataclasses.fields(ServerConfig) if f.name not in HIDDEN]
    assert set(HELP) == {f.name for f in fields}
    for action in parser._actions:
        if action.dest == "help":
            continue
        assert action.help and len(action.help) > 10, action.dest
        assert parser.formatter_class(prog="x")._get_help_string(action).endswith(")"), action.dest
    for f in fields:
        assert "--" + f.name.replace("_", "-") in text
    assert "(default: 127.0.0.1)" in text and "(default: 0.85)" in text and "(default: False)" in text


def test_flags_build_the_config() -> None:
    from engine.args import parse_args

    cfg = parse_args(["--cpu-threads", "2", "--disable-overlap", "--page-size", "32"])
    assert cfg.cpu_threads == 2 and cfg.disable_overlap and cfg.page_size == 32


def test_sglang_and_vllm_flag_names(capsys: pytest.CaptureFixture[str]) -> None:
    """An audit: `--tp 2`, `--model-path`, `--max-model-len` ... were "unrecognized arguments". Their
    twins are aliases; flags with none here are an exit 2 that names what to use."""
    from engine.args import parse_args

    cfg = parse_args(["--tp", "2", "--max-model-len", "512", "--max-num-seqs", "8", "--random-seed", "3",
                      "--chunked-prefill-size", "256", "--enforce-eager", "--cpu-threads", "1"])
    assert (cfg.tp_size, cfg.context_length, cfg.max_running_requests, cfg.seed, cfg.max_prefill_tokens) == \
        (2, 512, 8, 3, 256) and cfg.disable_cuda_graph
    assert parse_args(["--tensor-parallel-size=2", "--max-num-batched-tokens", "128"]).tp_size == 2
    for argv, says in ((["--mem-fraction-static", "0.8"], "here use --mem-fraction"),
                       (["--trust-remote-code"], "no model code from a checkpoint runs here"),
                       (["--log-level=debug"], "STRATA_LOG_LEVEL")):
        with pytest.raises(SystemExit) as exit_:
            parse_args(argv)
        assert exit_.value.code == 2 and says in capsys.readouterr().err
    with pytest.raises(SystemExit):  # still no abbreviations
        parse_args(["--max-running", "4"])
    cfg = parse_args(["--dtype", "half", "--kv-cache-dtype", "fp8", "--tool-call-parser", "deepseekv3",
                      "--reasoning-parser", "deepseek_r1"])
    assert (cfg.dtype, cfg.kv_cache_dtype) == ("float16", "fp8_e4m3")
    assert parse_args(["--speculative-algorithm", "ngram"]).speculative_algorithm == "NGRAM"


def test_auto_page_size_is_64_for_mla_models_on_cuda_only() -> None:
    """--page-size 0 (the default): 16, but 64 (FlashMLA's page) for an MLA model on CUDA; an explicit
    size stands; the resolved size survives the JSON every child process decodes."""
    from pathlib import Path

    v3 = str(Path(__file__).resolve().parents[2] / "configs" / "deepseek-v3-5l")
    llama = str(Path(__file__).resolve().parents[2] / "configs" / "llama-3.1-8b")
    assert ServerConfig().page_size == 16
    assert ServerConfig(model=v3, device="cpu").page_size == 16
    assert ServerConfig(model=llama, device="cuda").page_size == 16
    cfg = ServerConfig(model=v3, device="cuda")
    assert cfg.page_size == 64 and ServerConfig.from_json(cfg.to_json()).page_size == 64
    assert ServerConfig(model=v3, device="cuda", page_size=16).page_size == 16
    with pytest.raises(ValueError, match="power of 2"):
        ServerConfig(page_size=24)
    with pytest.raises(ValueError, match="--max-prefill-tokens 32 must be >= page size 64"):
        ServerConfig(model=v3, device="cuda", max_prefill_tokens=32)


def test_http_and_sdk_ports_differ() -> None:
    """One port for both listeners is refused at start (a benchmark whose two free-port picks
    came out equal hung its client); free_ports picks distinct ones."""
    with pytest.raises(ValueError, match="--sdk-port must differ from --port"):
        ServerConfig(port=8000, sdk_port=8000)
    ports = free_ports(16)
    assert len(set(ports)) == 16 and all(0 < p < 65536 for p in ports)


def test_a_model_given_as_dot_is_named_by_its_directory(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """An audit: `--model .` served the model as "" (Path(".").name), a name no request could use."""
    (tmp_path / "my-model").mkdir()
    monkeypatch.chdir(tmp_path / "my-model")
    assert ServerConfig(model=".").model_name == "my-model"
    assert ServerConfig(model=str(tmp_path / "my-model")).model_name == "my-model"


def test_an_empty_api_key_flag_clears_the_environments(monkeypatch: pytest.MonkeyPatch) -> None:
    """STRATA_API_KEY fills --api-key when the flag is not given; `--api-key ""` means no key."""
    from engine import env as env_mod
    from engine.args import parse_args

    monkeypatch.setenv("STRATA_API_KEY", "from-env")
    env_mod.env.cache_clear()
    try:
        assert parse_args([]).api_key == "from-env"
        assert parse_args(["--api-key", ""]).api_key == "" and parse_args(["--api-key="]).api_key == ""
        assert parse_args(["--api-key", "flag"]).api_key == "flag"
    finally:
        env_mod.env.cache_clear()


def test_several_served_model_names(capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM's `--served-model-name a b`: the first is the name the API reports, the others are accepted
    too (engine/serve/state.py); a name given twice is an exit 2 naming the flag."""
    from engine.args import parse_args

    cfg = parse_args(["--served-model-name", "main", "alias-1", "alias-2"])
    assert cfg.model_name == "main" and cfg.served_model_aliases == ("alias-1", "alias-2")
    assert ServerConfig.from_json(cfg.to_json()) == cfg  # (as the children get it)
    one = parse_args(["--served-model-name", "main"])
    assert one.model_name == "main" and one.served_model_aliases == ()
    assert parse_args([]).served_model_aliases == ()
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--served-model-name", "main", "x", "x"])
    assert exit_.value.code == 2 and "--served-model-name" in capsys.readouterr().err


def test_scheduling_policy_flag() -> None:
    """vLLM's --scheduling-policy: fcfs (the default) or priority; anything else exits at start."""
    from engine.args import parse_args

    assert parse_args([]).scheduling_policy == "fcfs"
    assert parse_args(["--scheduling-policy", "priority"]).scheduling_policy == "priority"
    with pytest.raises(SystemExit):
        parse_args(["--scheduling-policy", "lifo"])
