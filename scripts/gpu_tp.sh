#!/usr/bin/env bash
# One device call on 2 GPUs (kind nvidia-h200-x2, carry .whl): the tensor-parallel probes, each
# part in its own timeout so that one failing or hanging part does not stop the others, then a
# summary. About 6-8 minutes (timeouts: 80 + 110 + 290 s). Results in $OUT (at most 8 files):
#   tp-probe.json       all-reduce per size (NCCL / the engine's copy + one-shot, eager / CUDA graph;
#                       torch's copy-in-kernel one-shot and two-shot in graphs for comparison),
#                       correctness against NCCL and a back-to-back stress count; the triton GEMVs
#                       vs cuBLAS on Llama-3.1-8B's tp=2 shard and tp=1 shapes
#   tp-agree-fp32.json  greedy tokens tp=2 vs tp=1, float32, torch attention, no CUDA graph, Llama-3.1-8B
#                       cut to 4 layers (dummy weights): must agree; one-shot and NCCL all-reduce
#   tp-llama-8b.json    Llama-3.1-8B bf16 decode, batch 1 and 8, ctx 1024, CUDA graphs: tp=1,
#                       tp=2 one-shot, tp=2 NCCL
#   summary.txt         the tables (also printed), logs.tgz: every log
# Those three are the mode `probe` (the default). Other modes:
#   offline             Llama-3.1-8B offline 256 x 1000/1000 through bin/serve at tp=2, then tp=1
#   70b                 Llama-3.1-70B (dummy, ~70 GB of bf16 weights a rank) batch-1 decode at tp=2,
#                       one-shot all-reduce (it fits no single H200)
# Usage on the device: bash scripts/gpu_tp.sh [probe] [offline] [70b]
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD FLASHINFER_NO_DOWNLOAD=1 PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 \
  TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 STRATA_PYTHON=python3
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" "$OUT/logs"
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,memory.total --format=csv; nvidia-smi topo -m; \
  python3 -c 'import torch; print("torch", torch.__version__, "gpus", torch.cuda.device_count(), "nccl", torch.cuda.nccl.version())'; \
} > "$OUT/logs/gpu.txt" 2>&1
cat "$OUT/logs/gpu.txt"
part() {  # name, timeout seconds, command...: output to logs/<name>.log, never stops the script
  local name=$1 t=$2; shift 2
  echo "=== $name (timeout $t s, at $(( $(date +%s) - T0 )) s)"; local t1=$(date +%s)
  timeout -k 10 "$t" "$@" > "$OUT/logs/$name.log" 2>&1; local rc=$?
  echo "rc=$rc in $(( $(date +%s) - t1 )) s"
  [ $rc = 0 ] || tail -25 "$OUT/logs/$name.log"
}
M=configs/llama-3.1-8b
MODES="${*:-probe}"
for mode in $MODES; do case $mode in
  probe|offline|70b) ;; *) echo "gpu_tp.sh: unknown mode '$mode' (probe offline 70b)" >&2; exit 2 ;; esac; done
if [[ " $MODES " == *" offline "* ]]; then
  for tp in 2 1; do
    part offline-tp$tp 200 bin/bench offline --model $M --load-format dummy --num-requests 256 --input-len 1000 \
      --output-len 1000 --server-args "--tp-size $tp --max-running-requests 256 --max-prefill-tokens 16384" \
      --out "$OUT/offline-llama-3.1-8b-1000-1000-tp$tp-h200x2.json"
    grep -E "Output token throughput|Benchmark duration" "$OUT/logs/offline-tp$tp.log"
  done
fi
if [[ " $MODES " == *" 70b "* ]]; then
  part llama-70b 280 python3 scripts/tp_bench.py --model configs/llama-3.1-70b --runs 2:symm \
    --batch-sizes 1 --context-len 1024 --steps 48 --timeout 260 --out "$OUT/tp-llama-70b.json"
  grep -E 'decode median|FAILED|retrying' "$OUT/logs/llama-70b.log"
fi
if [[ " $MODES " != *" probe "* ]]; then
  tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"; ls "$OUT"; exit 0
fi
part probe 80 python3 scripts/tp_probe.py micro --out "$OUT/tp-probe.json"
grep -E '^\{' "$OUT/logs/probe.log" | head -40
# the one-shot runs only where the probe's one-shot all-reduce worked (a hang there would cost each run its timeout)
if python3 -c "import json, sys; p = json.load(open('$OUT/tp-probe.json')); \
sys.exit(0 if any(r.get('symm_equals_nccl') for r in p['allreduce']) else 1)" 2>/dev/null; then
  AGREE_RUNS="1 2:symm 2:nccl"; LLAMA_RUNS="1 2:symm 2:nccl"
else
  echo "one-shot all-reduce did not work in the probe: NCCL runs only"
  AGREE_RUNS="1 2:nccl"; LLAMA_RUNS="1 2:nccl"
fi
part agree-fp32 110 python3 scripts/tp_bench.py --model $M --layers 4 --dtype float32 --attention-backend torch \
  --disable-cuda-graph --runs $AGREE_RUNS --batch-sizes 1 --context-len 256 --steps 32 --timeout 90 \
  --out "$OUT/tp-agree-fp32.json"
grep -E 'decode median|FAILED' "$OUT/logs/agree-fp32.log"
part llama-8b 290 python3 scripts/tp_bench.py --model $M --runs $LLAMA_RUNS \
  --batch-sizes 1 8 --context-len 1024 --steps 64 --timeout 150 --out "$OUT/tp-llama-8b.json"
grep -E 'decode median|FAILED|retrying' "$OUT/logs/llama-8b.log"
python3 scripts/tp_probe.py summary "$OUT" | tee "$OUT/summary.txt"
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
echo "gpu_tp.sh: done in $(( $(date +%s) - T0 )) s"; ls "$OUT"
