#!/usr/bin/env bash
# untracked: one device call's steps
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD FLASHINFER_NO_DOWNLOAD=1 PYTHONUNBUFFERED=1 STRATA_PYTHON=python3
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
timeout 200 python3 -m pytest -m gpu tests/gpu/test_invariant_gemm_gpu.py -k cuda_gemv -q -rA -p no:cacheprovider 2>&1 | grep -E "PASSED|FAILED|ERROR|passed|failed|Error" | tail -12
echo "t=$(( $(date +%s) - t0 ))"
timeout 200 python3 -m pytest -m gpu tests/gpu/test_gpu_path.py tests/cache/test_tier_gpu.py -q -rA -p no:cacheprovider -x 2>&1 | grep -E "PASSED|FAILED|ERROR|passed|failed|Error|assert" | tail -30
echo "t=$(( $(date +%s) - t0 ))"
DETGEMV_PROBE=0 DETGEMV_ROUNDS=1 DETGEMV_MODELS=llama-3.1-8b timeout $(( 570 - $(date +%s) + t0 )) bash scripts/gpu_bench.sh detgemv
echo "t=$(( $(date +%s) - t0 ))"
