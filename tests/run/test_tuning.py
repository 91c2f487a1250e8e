"""engine/layers/tuning.py: the per-GPU tuning files and the rules they encode (CPU only)."""

from __future__ import annotations

import json

import pytest
import torch

from engine.layers.tuning import (
    DEFAULT,
    TUNING_DIR,
    DecodeRule,
    KernelTuning,
    kernel_tuning,
    load_tuning,
    override_tuning,
    parse_tuning,
    tuning_file,
)

BF, F8 = torch.bfloat16, torch.float8_e4m3fn
H200 = load_tuning("NVIDIA H200")


def test_file_is_chosen_by_device_name() -> None:
    assert tuning_file("NVIDIA H200") == TUNING_DIR / "NVIDIA_H200.json"
    assert tuning_file("NVIDIA H100 80GB HBM3") == TUNING_DIR / "NVIDIA_H100_80GB_HBM3.json"
    assert H200.gpu == "NVIDIA H200"
    assert load_tuning("Some Future GPU") is DEFAULT
    assert kernel_tuning(torch.device("cpu")) is DEFAULT


def test_every_checked_in_file_parses() -> None:
    files = sorted(TUNING_DIR.glob("*.json"))
    assert files, "no tuning files"
    for f in files:
        parse_tuning(json.loads(f.read_text()), f.stem)


def test_h200_values_are_the_measured_defaults() -> None:
    """The values docs/PERF.md measured as the defaults before they moved into the file."""
    t = H200
    assert t.triton_pdl and t.fused_prologue and t.triton_gemv
    assert t.gemv_max_rows == 4 and t.norm_gemv_max_hidden == 2048
    # decode: triton up to batch 16 with bf16 KV, FA2 above; XQA for fp8 KV; forced names win
    assert [t.decode_kernel("auto", True, True, BF, b) for b in (1, 16, 17, 256)] == ["triton", "triton", "fa2", "fa2"]
    assert t.decode_kernel("auto", True, False, BF, 1) == "fa2"
    assert t.decode_kernel("auto", True, True, F8, 1) == "xqa" == t.decode_kernel("auto", True, True, F8, 256)
    assert t.decode_kernel("auto", False, True, F8, 1) == "triton"
    assert t.decode_kernel("auto", False, True, F8, 32) == "fa2"
    assert t.decode_kernel("xqa", True, True, BF, 256) == "xqa"
    assert t.decode_kernel("triton", True, True, F8, 256) == "triton"
    assert t.decode_kernel("fa2", True, True, F8, 1) == "fa2"
    assert t.decode_kernel("xqa", False, True, F8, 1) == "fa2"  # named but unsupported: FA2
    assert t.max_decode_batch("triton", BF) == 16 and t.max_decode_batch("xqa", BF) == 0
    assert t.max_decode_batch("xqa", F8) is None
    # GEMV tiles: the rule that was built into triton_ops.gemv_config
    want = {
        (1024, 1024): (8, 1024, 4, 1), (4096, 1024): (8, 1024, 4, 1), (1024, 2048): (4, 2048, 4, 1),
        (1024, 3072): (4, 4096, 4, 1), (2048, 4096): (2, 2048, 4, 3), (6144, 4096): (8, 512, 4, 3),
        (1536, 7168): (4, 1024, 4, 3), (5120, 2048): (16, 2048, 4, 3), (4096, 2048): (4, 2048, 4, 1),
        (5120, 4096): (8, 512, 4, 3),
        (28672, 4096): (16, 256, 4, 4), (4096, 14336): (8, 512, 4, 3), (4096, 1000): None,
    }
    assert {nk: t.gemv_config(*nk) for nk in want} == want
    # rows a GEMV takes: the measured 8192-element one-tile configs up to 4; wider tiles (fp8 gate_up's
    # 4 x 4096, bf16 K = 3072's padded 4 x 4096) and looped ones one
    assert t.gemv_rows(t.gemv_config(1024, 1024)) == t.gemv_rows(t.gemv_config(1024, 2048)) == 4
    assert t.gemv_rows(t.gemv_config(28672, 4096, fp8=True)) == 1 == t.gemv_rows(t.gemv_config(1024, 3072))
    assert t.gemv_config(28672, 4096, fp8=True) == (4, 4096, 4, 3)
    # row-scaled fp8 GEMMs: triton where cuBLASLt's tiles leave SMs idle, cuBLASLt elsewhere
    assert t.fp8_row_config(128, 6144, 4096) == (64, 64, 128, 4, 5) == t.fp8_row_config(64, 4096, 14336)
    assert t.fp8_row_config(256, 4096, 14336) == (64, 128, 128, 4, 5)
    assert t.fp8_row_config(256, 28672, 4096) == (128, 256, 128, 8, 3)
    assert t.fp8_row_config(256, 6144, 4096) is None and t.fp8_row_config(257, 4096, 4096) is None
    assert t.fp8_row_config(64, 4096, 4000) is None  # K not a multiple of block_k


def test_unknown_gpu_uses_only_vendor_kernels() -> None:
    t = DEFAULT
    assert not (t.triton_pdl or t.fused_prologue or t.triton_gemv or t.norm_gemv_max_hidden)
    assert t.gemv_config(1024, 1024) is None
    assert t.decode_kernel("auto", True, True, BF, 1) == "fa2"
    assert t.decode_kernel("auto", True, True, F8, 1) == "xqa"
    assert t.decode_kernel("triton", True, True, BF, 1) == "triton"  # --decode-kernel still forces


def test_bad_files_are_errors() -> None:
    with pytest.raises(ValueError, match="unknown keys"):
        parse_tuning({"triton_pdll": True}, "x")
    with pytest.raises(ValueError, match="unknown kernels"):
        parse_tuning({"decode_bf16": [{"kernel": "fa3"}]}, "x")
    with pytest.raises(ValueError, match="gemv_max_rows"):
        parse_tuning({"gemv_max_rows": 9}, "x")
    with pytest.raises(ValueError, match="fp8_row_triton"):
        parse_tuning({"fp8_row_triton": [{"max_rows": 64, "config": [64, 64, 128, 4]}]}, "x")
    with pytest.raises(ValueError, match="--decode-kernel"):
        KernelTuning().decode_kernel("fast", True, True, BF, 1)
    t = parse_tuning({"_comment": "ignored", "decode_bf16": [{"kernel": "xqa", "max_batch": 4}]}, "x")
    assert t.decode_bf16 == (DecodeRule("xqa", 4),)


def test_shard_shapes_find_rules() -> None:
    """Tensor-parallel shards are looked up by their own [N, K]: Llama-3.1-8B's at tp 2 (QKV,
    o_proj, gate_up, down) all have a GEMV; a K no rule takes keeps cuBLAS."""
    want = {(3072, 4096): (8, 512, 4, 3), (4096, 2048): (4, 2048, 4, 1), (14336, 4096): (8, 512, 4, 3),
            (4096, 7168): (8, 512, 4, 3), (4096, 1000): None, (1536, 40): None}
    assert {nk: H200.gemv_config(*nk) for nk in want} == want


def test_symm_allreduce_threshold_defaults_to_nccl() -> None:
    assert DEFAULT.tp_symm_allreduce_max_bytes == 0  # no tuning entry: NCCL for every size
    assert parse_tuning({"tp_symm_allreduce_max_bytes": 65536}, "x").tp_symm_allreduce_max_bytes == 65536
    with pytest.raises(ValueError, match="tp_symm_allreduce_max_bytes"):
        parse_tuning({"tp_symm_allreduce_max_bytes": -1}, "x")


def test_override_tuning_replaces_fields_until_reset() -> None:
    try:
        override_tuning(tp_symm_allreduce_max_bytes=1 << 20, gemv_max_rows=2)
        t = load_tuning("NVIDIA H200")
        assert (t.tp_symm_allreduce_max_bytes, t.gemv_max_rows, t.triton_gemv) == (1 << 20, 2, True)
        u = load_tuning("Some Future GPU")  # no file: the defaults with the override
        assert u.tp_symm_allreduce_max_bytes == 1 << 20 and not u.triton_gemv
        assert kernel_tuning(torch.device("cpu")) is DEFAULT  # off CUDA nothing runs these kernels
        with pytest.raises(ValueError, match="unknown"):
            override_tuning(triton_pdll=True)
        with pytest.raises(ValueError, match="unknown"):
            override_tuning(gpu="x")
    finally:
        override_tuning()
    assert load_tuning("Some Future GPU") is DEFAULT and load_tuning("NVIDIA H200") == H200
