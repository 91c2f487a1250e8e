"""`bin/bench cpu`: its arguments, workload and figures (the end-to-end run needs the real
weights and minutes, so it is a benchmark, not a test), and the transformers baseline's
generate on a tiny saved model (equal-length and left-padded prompts)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.bench import cli, cpu


def args_of(*argv: str):  # noqa: ANN201
    return cli.build_parser().parse_args(["cpu", *argv])


def test_defaults_and_checks() -> None:
    a = args_of()
    assert (a.batch, a.input_len, a.output_len, a.long_prompt_len, a.rounds) == (16, 128, 64, 8191, 3)
    assert cli.check(a) is None
    assert cli.check(args_of("--rounds", "0")) is not None
    assert "dummy" in cli.check(args_of("--load-format", "dummy"))
    assert cli.check(args_of("--batch", "0")) is not None
    assert cli.check(args_of("--long-prompt-len", "-1")) is not None


def test_every_cpu_flag_says_its_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["cpu", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for default in ("(default: 16)", "(default: 128)", "(default: 64)", "(default: 8191)", "(default: 3)"):
        assert default in text


def test_workload_is_seeded() -> None:
    a = args_of("--batch", "3", "--input-len", "5", "--long-prompt-len", "7")
    reqs, long_prompt = cpu.workload_of(a, 100)
    assert [len(r.prompt) for r in reqs] == [5, 5, 5] and {r.output_len for r in reqs} == {64}
    assert len(long_prompt) == 7 and cpu.workload_of(a, 100) == (reqs, long_prompt)
    other, same_long = cpu.workload_of(a, 100, round_=1)  # a fresh batch per round: no prefix-cache hits
    assert same_long == long_prompt and all(r.prompt != o.prompt for r, o in zip(reqs, other, strict=True))


def test_figures_are_medians_over_rounds() -> None:
    a = args_of("--batch", "2", "--output-len", "4", "--long-prompt-len", "10")
    hf = {"threads": 2, "generate_s": [2.0, 9.0, 3.0], "forward_s": 4.0, "forward_next_id": 9,
          "generate_ids": [[[1, 2, 3, 4], [5, 6, 7, 8]]] * 3}
    ours = {"served_s": [1.0, 3.0, 2.0], "ttft_s": 5.0, "ttft_next_id": 9, "worker_rss_gib": 1.0,
            "worker_peak_rss_gib": 1.5, "served_ids": [[[1, 2, 3, 4], [5, 6, 7, 0]]] * 2 + [[[1, 2, 3, 4]] * 2]}
    f = cpu.figures(a, hf, ours)
    # the ratio is the median of the paired rounds' ratios (2, 3, 1.5), not of the medians (3 / 2)
    assert (f["hf_generate_s"], f["served_s"], f["throughput_ratio"]) == (3.0, 2.0, 2.0)
    assert (f["hf_output_tok_s"], f["served_output_tok_s"]) == (8 / 3.0, 8 / 2.0)
    assert f["throughput_ratio_rounds"] == [2.0, 3.0, 1.5] and f["rounds"] == 3
    assert (f["rows_equal_to_hf"], f["completed"], f["ttft_ratio"], f["long_next_token_equal"]) == (3, 6, 1.25, True)


def test_baseline_generate_runs_every_row_to_its_length(tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from engine.bench import hf_baseline

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, eos_token_id=3)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    model = hf_baseline.load(str(tmp_path))
    seconds, ids = hf_baseline.generate(model, [[5, 6, 7], [8, 9]], 6)
    assert seconds > 0 and [len(row) for row in ids] == [6, 6]  # no early EOS stop, padding dropped
    _, alone = hf_baseline.generate(model, [[8, 9]], 6)
    assert ids[1] == alone[0]  # left padding is masked out
    seconds, nxt = hf_baseline.forward(model, [5, 6, 7])
    assert seconds > 0 and 0 <= nxt < 64


def test_the_transformers_child_answers_commands_until_closed(tmp_path: Path) -> None:
    """The child process the benchmark alternates with the server: the same answers as the
    in-process calls, one JSON line per command, and a clean exit when stdin closes."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from engine.bench import hf_baseline
    from engine.bench.workload import BenchRequest

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, eos_token_id=3)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    _, expected = hf_baseline.generate(hf_baseline.load(str(tmp_path)), [[5, 6, 7], [8, 9, 10]], 4)
    child = cpu.Transformers(tmp_path, "float32")
    try:
        assert child.threads >= 1
        for _ in range(2):
            seconds, ids = child.generate([BenchRequest([5, 6, 7], 4), BenchRequest([8, 9, 10], 4)], 4)
            assert seconds > 0 and ids == expected
        seconds, nxt = child.forward([5, 6, 7])
        assert seconds > 0 and 0 <= nxt < 64
    finally:
        child.close()
    assert child.proc.returncode == 0
