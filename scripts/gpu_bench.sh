#!/usr/bin/env bash
# One device call: install the carried wheels, then run the served-engine benchmarks on the
# H200 (offline throughput through the real process stack, online serving). Results go to $OUT.
# Usage on the device (carry .whl): bash scripts/gpu_bench.sh [qwen|llama|serve ...]
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD FLASHINFER_NO_DOWNLOAD=1 PYTHONUNBUFFERED=1 STRATA_PYTHON=python3
A=/tmp/site/flashinfer/data/aot; mkdir -p $A; [ -f .whl/fi_aot.tgz ] && tar xzf .whl/fi_aot.tgz -C $A
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# the device tree has no .git: pass STRATA_GIT_COMMIT=<commit> in the command to record it
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
run() {  # name, timeout, command...
  local name=$1 t=$2; shift 2
  echo "=== $name"; local t0=$(date +%s)
  timeout "$t" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "rc=$rc in $(( $(date +%s) - t0 )) s"; grep -A14 "Result ==" "$OUT/$name.log" | head -24
  [ $rc = 0 ] || { tail -40 "$OUT/$name.log"; for f in /tmp/strata-bench-*/serve.log; do [ -f "$f" ] && tail -60 "$f"; done; }
}
[ $# -gt 0 ] || set -- qwen llama serve
for what in "$@"; do case $what in
  qwen) run offline-qwen3-0.6b 200 bin/bench offline --model configs/qwen3-0.6b --load-format dummy \
          --num-requests 256 --server-args "--max-running-requests 256 --max-prefill-tokens 16384 --log-dir $OUT/logs-qwen" \
          --out "$OUT/offline-qwen3-0.6b-h200.json"; grep -h '"gpu idle"' $OUT/logs-qwen/worker-0.log | tail -3 ;;
  llama) run offline-llama-3.1-8b 260 bin/bench offline --model configs/llama-3.1-8b --load-format dummy \
          --num-requests 256 --input-len 1000 --output-len 1000 \
          --server-args "--max-running-requests 256 --max-prefill-tokens 16384 --log-dir $OUT/logs-llama" \
          --out "$OUT/offline-llama-3.1-8b-1000-1000-h200.json"; grep -h '"gpu idle"' $OUT/logs-llama/worker-0.log | tail -3 ;;
  llama512) run offline-llama-3.1-8b-512 200 bin/bench offline --model configs/llama-3.1-8b --load-format dummy \
          --num-requests 512 --input-len 1000 --output-len 1000 \
          --server-args "--max-running-requests 384 --max-prefill-tokens 16384 --mem-fraction 0.92" \
          --out "$OUT/offline-llama-3.1-8b-1000-1000-512req-h200.json" ;;
  serve) run serve-qwen3-0.6b 120 bin/bench serve --model configs/qwen3-0.6b --load-format dummy \
          --num-requests 400 --request-rate 40 --server-args "--max-running-requests 256" \
          --out "$OUT/serve-qwen3-0.6b-h200.json" ;;
  latency) for m in qwen3-0.6b llama-3.1-8b; do
            run latency-$m 150 bin/bench latency --model configs/$m --load-format dummy --batch-sizes 1 8 32 \
              --context-len 1024 --steps 50 --profile-idle --out "$OUT/latency-$m-h200.json"; done ;;
  check8) run gpu-check-fp8 200 python3 scripts/gpu_check.py --skip transformers --kv-cache-dtype fp8_e4m3 \
            --json "$OUT/gpu_check-fp8kv-h200.json"; grep -E "logits|FAIL|checks passed" "$OUT/gpu-check-fp8.log" | tail -16 ;;
  check8m) run gpu-check-fp8math 200 python3 scripts/gpu_check.py --skip transformers --kv-cache-dtype fp8_e4m3 \
            --attention-fp8-math --tol 0.08 --json "$OUT/gpu_check-fp8kv-fp8math-h200.json"
           grep -E "logits|FAIL|checks passed" "$OUT/gpu-check-fp8math.log" | tail -16 ;;
  gemv) run gemv-probe 200 python3 scripts/gemv_probe.py --json "$OUT/gemv_probe-h200.json"; grep -v -i warn "$OUT/gemv-probe.log" | tail -12 ;;
  llama8) run offline-llama-3.1-8b-fp8kv 200 bin/bench offline --model configs/llama-3.1-8b --load-format dummy \
          --num-requests 256 --input-len 1000 --output-len 1000 \
          --server-args "--max-running-requests 256 --max-prefill-tokens 16384 --kv-cache-dtype fp8_e4m3 --log-dir $OUT/logs-llama8" \
          --out "$OUT/offline-llama-3.1-8b-1000-1000-fp8kv-h200.json"; grep -h '"gpu idle"' $OUT/logs-llama8/worker-0.log | tail -2 ;;
  llama8m) run offline-llama-3.1-8b-fp8math 200 bin/bench offline --model configs/llama-3.1-8b --load-format dummy \
          --num-requests 256 --input-len 1000 --output-len 1000 \
          --server-args "--max-running-requests 256 --max-prefill-tokens 16384 --kv-cache-dtype fp8_e4m3 --attention-fp8-math --log-dir $OUT/logs-llama8m" \
          --out "$OUT/offline-llama-3.1-8b-1000-1000-fp8kv-fp8math-h200.json"; grep -h '"gpu idle"' $OUT/logs-llama8m/worker-0.log | tail -2 ;;
  pack) tar czf /tmp/logs.tgz -C "$OUT" --exclude='*.json' . && find "$OUT" -mindepth 1 ! -name '*.json' -delete \
          && mv /tmp/logs.tgz "$OUT/"; ls "$OUT" ;;  # the device returns at most 8 files
  llama8x) run offline-llama-3.1-8b-fp8kv-512 200 bin/bench offline --model configs/llama-3.1-8b --load-format dummy \
          --num-requests 512 --input-len 1000 --output-len 1000 \
          --server-args "--max-running-requests 512 --max-prefill-tokens 16384 --kv-cache-dtype fp8_e4m3" \
          --out "$OUT/offline-llama-3.1-8b-1000-1000-fp8kv-512req-h200.json" ;;
  profile) run profile-llama 150 python3 scripts/profile_decode.py configs/llama-3.1-8b 256 1500
           grep -A16 "kernels per decode step" "$OUT/profile-llama.log" ;;
  profile1) for m in qwen3-0.6b llama-3.1-8b; do
             run profile-$m-b1 120 python3 scripts/profile_decode.py configs/$m 1 1024
             grep -A26 "kernels per decode step" "$OUT/profile-$m-b1.log"; done ;;
  quick) run gpu-check-quick 120 python3 scripts/gpu_check.py --skip logits transformers; grep -E "FAIL|checks passed" "$OUT/gpu-check-quick.log" | tail -5
         for m in qwen3-0.6b llama-3.1-8b; do
           run latency-$m-b1 100 bin/bench latency --model configs/$m --load-format dummy --batch-sizes 1 4 8 \
             --context-len 1024 --steps 50 --out "$OUT/latency-$m-small-h200.json"
           grep -A6 "batch  ctx" "$OUT/latency-$m-b1.log"; done ;;
  latency8) for m in qwen3-0.6b llama-3.1-8b; do
            run latency-$m-fp8kv 150 bin/bench latency --model configs/$m --load-format dummy --batch-sizes 1 8 32 \
              --context-len 1024 --steps 50 --server-args "--kv-cache-dtype fp8_e4m3" \
              --out "$OUT/latency-$m-fp8kv-h200.json"; done ;;
  latencyfa2) for m in qwen3-0.6b llama-3.1-8b; do
            STRATA_DECODE_KERNEL=fa2 run latency-$m-fa2 150 bin/bench latency --model configs/$m --load-format dummy \
              --batch-sizes 1 --context-len 1024 --steps 50 --out "$OUT/latency-$m-fa2-decode-h200.json"; done ;;
  checknf) STRATA_NORM_GEMV=0 run gpu-check-nonormgemv 200 python3 scripts/gpu_check.py --skip transformers \
            --json "$OUT/gpu_check-no-norm-gemv-h200.json"; grep -E "FAIL|checks passed" "$OUT/gpu-check-nonormgemv.log" | tail -5 ;;
  checkfa2) STRATA_DECODE_KERNEL=fa2 run gpu-check-fa2 200 python3 scripts/gpu_check.py --skip transformers \
            --json "$OUT/gpu_check-fa2-decode-h200.json"; grep -E "FAIL|checks passed" "$OUT/gpu-check-fa2.log" | tail -5 ;;
  tune) run gemv-tune 200 python3 scripts/gemv_probe.py --only llama --tune-out "$OUT/gemv_tune.json" \
          --json "$OUT/gemv_probe-llama-tune-h200.json"; grep -v -i warn "$OUT/gemv-tune.log" | tail -5; cat "$OUT/gemv_tune.json"
        STRATA_GEMV_TUNE=$OUT/gemv_tune.json run latency-llama-tuned 100 bin/bench latency --model configs/llama-3.1-8b \
          --load-format dummy --batch-sizes 1 --context-len 1024 --steps 100 --out "$OUT/latency-llama-3.1-8b-b1-tuned-h200.json" ;;
  latencypdl) for v in 0 1; do for m in llama-3.1-8b qwen3-0.6b; do
            STRATA_TRITON_PDL=$v run latency-$m-pdl$v 100 bin/bench latency --model configs/$m --load-format dummy \
              --batch-sizes 1 --context-len 1024 --steps 100 --out "$OUT/latency-$m-b1-pdl$v-h200.json"; done; done ;;
  latencynorm) for v in 1 0; do for m in llama-3.1-8b qwen3-0.6b; do
            STRATA_NORM_GEMV=$v run latency-$m-normgemv$v 100 bin/bench latency --model configs/$m --load-format dummy \
              --batch-sizes 1 --context-len 1024 --steps 100 --out "$OUT/latency-$m-b1-normgemv$v-h200.json"; done; done ;;
  latencyab) for v in "STRATA_DECODE_KERNEL=fa2" "STRATA_FUSED_PROLOGUE=0" "STRATA_XQA_PDL=0"; do
            env $v bin/bench latency --model configs/llama-3.1-8b --load-format dummy --batch-sizes 1 \
              --context-len 1024 --steps 50 --out "$OUT/latency-llama-ab-${v%%=*}.json" 2>&1 | grep -A3 "batch  ctx" | sed "s/^/$v /"; done ;;
  fused) run attn-fused 240 python3 scripts/attn_probe.py --skip prologue attention --json "$OUT/attn_probe-fused-h200.json"
         grep "^fused" "$OUT/attn-fused.log" ;;
  checktr) STRATA_DECODE_KERNEL=triton run gpu-check-triton 200 python3 scripts/gpu_check.py --skip transformers \
            --json "$OUT/gpu_check-triton-decode-h200.json"; grep -E "FAIL|checks passed" "$OUT/gpu-check-triton.log" | tail -5 ;;
  latencydk) for v in fa2 auto; do for m in qwen3-0.6b llama-3.1-8b; do
            STRATA_DECODE_KERNEL=$v run latency-$m-dk-$v 100 bin/bench latency --model configs/$m --load-format dummy \
              --batch-sizes 1 2 8 --context-len 1024 --steps 100 --out "$OUT/latency-$m-decode-$v-h200.json"
            grep -A7 "batch  ctx" "$OUT/latency-$m-dk-$v.log"; done; done ;;
  rowsab) for v in 1 8; do for m in qwen3-0.6b llama-3.1-8b; do
            STRATA_GEMV_MAX_ROWS=$v bin/bench latency --model configs/$m --load-format dummy --batch-sizes 1 2 4 8 \
              --context-len 1024 --steps 100 --out "$OUT/latency-$m-gemv-rows$v-h200.json" 2>&1 \
              | grep -A6 "^batch    ctx" | sed "s|^|$m rows<=$v |"; done; done ;;
  attn) run attn-probe 300 python3 scripts/attn_probe.py --json "$OUT/attn_probe-h200.json"; grep -v -i warn "$OUT/attn-probe.log" | tail -20 ;;
  check) run gpu-check 150 python3 scripts/gpu_check.py --json "$OUT/gpu_check-h200.json"; tail -30 "$OUT/gpu-check.log" ;;
  probe) run probe-qwen 90 python3 scripts/decode_probe.py configs/qwen3-0.6b 1; cat "$OUT/probe-qwen.log" | grep -v "it/s" | tail -40 ;;
esac; done
