#!/usr/bin/env bash
# Issue 26 on two GPUs (kind nvidia-h200-x2, carry .whl): context and expert parallelism measured, each
# part in its own timeout (one that fails or hangs costs only itself), NVLink multicast off. Modes, in
# the order to run them (about one device call of <= 10 minutes each; cold start excluded):
#   cp        Llama-3.1-8B (dummy) at cp=1 then cp=2: KV capacity (strata_kv_pages_total), TTFT of a
#             130,816-token prompt, batch-1 decode at that context (128 tokens streamed from the cached prompt)
#             (targets: TTFT <= 0.55x, decode <= 0.65x, capacity ~2x)
#   cpagree   Llama-3.1-8B cut to 4 layers, float32, torch attention: greedy tokens of 4 x 8192-token prompts
#             (16 new each) at cp=1 and cp=2, compared
#   cpcache   bin/bench cache at cp=2 (32k prompt): recompute vs L1 vs the shared host tier (L2), tokens vs fresh
#   ep        Qwen3-30B-A3B (dummy, bf16) offline 256 x 1000/1000 at ep=2, tp=2 and one GPU
#   epagree   Qwen3-30B-A3B cut to 4 layers, float32, torch attention: greedy tokens at tp=1, tp=2, ep=2, compared
#   kill      Qwen3-0.6B at cp=2: a worker killed with 4 requests in flight (stop time, every client told, no orphan)
# Usage on the device: STRATA_GIT_COMMIT=<commit> bash scripts/gpu_two.sh MODE ... ; results in $OUT
# (served_probe-*.json, offline-*.json, cache-*.json, logs.tgz). scripts/served_probe.py is the probe.
set -uo pipefail
MODES="cp cpagree cpcache ep epagree kill"
[ $# -gt 0 ] || { echo "usage: bash scripts/gpu_two.sh MODE ... (modes: $MODES)" >&2; exit 2; }
for m in "$@"; do case " $MODES " in *" $m "*) ;; *) echo "gpu_two.sh: unknown mode '$m' ($MODES)" >&2; exit 2 ;; esac; done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD FLASHINFER_NO_DOWNLOAD=1 PYTHONUNBUFFERED=1 STRATA_PYTHON=python3 \
  NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/logs"
T0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/logs/gpu.txt" 2>&1; cat "$OUT/logs/gpu.txt"
part() {  # name, timeout seconds, command...: output to logs/<name>.log, never stops the script
  local name=$1 t=$2; shift 2
  echo "=== $name (timeout $t s, at $(( $(date +%s) - T0 )) s)"; local t1=$(date +%s)
  timeout -k 10 "$t" "$@" > "$OUT/logs/$name.log" 2>&1; local rc=$?
  echo "rc=$rc in $(( $(date +%s) - t1 )) s"; grep -E '^\{' "$OUT/logs/$name.log" | tail -1
  [ $rc = 0 ] || tail -25 "$OUT/logs/$name.log"
}
probe() { part "$1" "$2" python3 scripts/served_probe.py --load-format dummy --out "$OUT/served_probe-$1.json" "${@:3}"; }
L=configs/llama-3.1-8b
Q=configs/qwen3-30b-a3b
for mode in "$@"; do case $mode in
  cp) for cp in 1 2; do
        probe cp$cp 290 --model $L --prompt-len 130816 --decode-tokens 128 \
          --server-args "--cp-size $cp --context-length 131072 --max-prefill-tokens 16384 --max-running-requests 8"
      done ;;
  cpagree) for cp in 1 2; do
        probe cpagree$cp 240 --model $L --layers 4 --agree 4x8192+16 \
          --server-args "--cp-size $cp --dtype float32 --attention-backend torch --disable-cuda-graph --max-running-requests 4"
      done
      python3 scripts/served_probe.py --compare "$OUT/served_probe-cpagree1.json" "$OUT/served_probe-cpagree2.json" ;;
  cpcache) part cpcache 400 bin/bench cache --model $L --load-format dummy --prompt-len 32768 --repeat 2 \
        --server-args "--cp-size 2" --out "$OUT/cache-llama-3.1-8b-32k-cp2.json"
      grep -E "recompute|l1 |l2 |tokens_equal|error" "$OUT/logs/cpcache.log" | tail -8 ;;
  ep) for plan in "--tp-size 2 --ep-size 2:ep2" "--tp-size 2:tp2" ":tp1"; do
        part offline-${plan#*:} 290 bin/bench offline --model $Q --load-format dummy --num-requests 256 --input-len 1000 \
          --output-len 1000 --server-args "${plan%:*} --max-running-requests 256 --max-prefill-tokens 16384" \
          --out "$OUT/offline-qwen3-30b-a3b-1000-1000-${plan#*:}.json"
        grep -E "Output token throughput|Benchmark duration" "$OUT/logs/offline-${plan#*:}.log"
      done ;;
  epagree) for plan in ":tp1" "--tp-size 2:tp2" "--tp-size 2 --ep-size 2:ep2"; do
        probe epagree-${plan#*:} 240 --model $Q --layers 4 --agree 4x512+16 \
          --server-args "${plan%:*} --dtype float32 --attention-backend torch --disable-cuda-graph --max-running-requests 4"
      done
      for p in tp2 ep2; do python3 scripts/served_probe.py --compare "$OUT/served_probe-epagree-tp1.json" \
        "$OUT/served_probe-epagree-$p.json"; done ;;
  kill) probe kill 200 --model configs/qwen3-0.6b --kill-rank 1 --server-args "--cp-size 2" ;;
esac; done
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"; ls "$OUT"
