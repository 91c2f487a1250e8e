#!/usr/bin/env bash
# One device call: install the carried wheels, then run the named modes on the GPU machine (an
# H200). Results go to $OUT. An unknown mode fails before anything runs.
# Usage on the device (carry .whl): bash scripts/gpu_bench.sh MODE ...
# .whl, made here once per checkout: ../shared/gpu/fetch-wheels.sh uvicorn==0.54.0 starlette==1.10.0
#   h11==0.16.0 click==8.5.1 httptools==0.9.0 psutil==7.2.2 (the GPU machine lacks the HTTP server's
#   packages since 2026-12-01: without them every served mode fails at start-up); the grammar tests' stop
#   answers validate with jsonschema, which it lacks too: jsonschema==4.26.0 attrs==26.1.0
#   jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
# A worker's steps can be torch-profiled: STRATA_PROFILE_STEPS=FIRST:COUNT (table + timeline in --log-dir)
#   quick     the gpu tests of the grammar mask and the host tier's copies only
#   check     the gpu tests (tests/gpu: bf16, fp8 KV, fp8 math, forced triton decode, transformers), one line a test
#             (a cut run still says which passed); ~200 tests no longer fit one call: CHECK_PART=k/n runs the k-th of n
#             parts, whole files dealt by their test counts (e.g. 1/3, 2/3, 3/3 in three calls)
#   latency   decode latency, Qwen3-0.6B and Llama-3.1-8B, batch 1 8 32, ctx 1024 (docs/PERF.md)
#   qwen      Qwen3-0.6B offline throughput, 256 requests (docs/PERF.md)
#   llama8m   Llama-3.1-8B offline 1000/1000, fp8 KV cache + --attention-fp8-math
#   llama     Llama-3.1-8B offline 1000/1000, bf16 KV cache
#   serve     Qwen3-0.6B online serving, 400 requests at 40 req/s
#   profile1  kernels of decode steps (scripts/profile_decode.py): PROFILES="model:batch:ctx[:flag,flag]" entries
#             (default both models at batch 1, eager), e.g. "llama-3.1-8b:1:1024:--graphs,--quantization=fp8"
#   cache     Llama-3.1-8B TTFT of a 32k prompt: recompute vs L1 vs L2 vs L3 (bin/bench cache, L3 under /tmp)
#   structured 64 json_schema vs 64 unconstrained requests, Qwen3-0.6B (needs bench/tok-smollm2: the tokenizer)
#   l2decode  Qwen3-0.6B offline, 256 requests, L2 (host tier, write-through) off then on
#   hostcopy  host-tier copy GB/s (python -m engine.bench.hostcopy cuda); its gpu tests are in quick
#   det       deterministic inference: its gpu tests (decode in CUDA graphs = eager bits), then bin/bench deterministic
#             (Qwen3-0.6B, bf16, mode on)
#             (DET_SAMPLING=filtered: top_k/top_p under test, neighbours filtering otherwise)
#   sampler   the sampler's tests on CUDA (tests/run/test_sampler.py), then scripts/sampler_cost.py: what sampling
#             costs a step, deterministic inference off and on (ranked top_k candidates, cumsum top_p mass)
#   samplinglat decode latency with sampled requests (SAMPLING_MODELS, "qwen3-0.6b llama-3.1-8b"; batch 1 8 64, ctx
#             1024): greedy, Qwen3's generation_config (temperature 0.6, top_k 20, top_p 0.95), top_p 0.95 alone, and
#             greedy / Qwen3's under --enable-deterministic-inference (SAMPLING_DET=0 skips those; SAMPLING_TAGS="greedy
#             topp" runs only those: greedy qwen topp detgreedy detqwen)
#   detcost   Qwen3-0.6B offline, 64 x 256/128 tokens, deterministic inference off then on
#   detoffline Qwen3-0.6B 256 requests and Llama-3.1-8B 1000/1000, the mode off then on (DET_MODES, and
#             DETOFF_MODELS="llama" for one model)
#   detgemm   deterministic inference's triton GEMM: bits across row counts (decode vs prefill tiles), time vs
#             cuBLAS and vs the 64-row blocks (tests/gpu/test_invariant_gemm_gpu.py)
#   detgemv   deterministic inference's CUDA GEMV (scripts/det_gemv_probe.py: bits against the prefill tiles at 1-16
#             rows, time beside the triton GEMV), then decode latency with the mode on, the CUDA GEMV off / on / off / on
#             (tuning patches), and with the mode off (DETGEMV_MODELS: "llama-3.1-8b qwen3-0.6b"; batch 1 8, ctx 1024;
#             DETGEMV_PROBE=0 skips the probe; DETGEMV_ROUNDS, default 2, the off / on pairs)
#   detfold   deterministic inference's RMSNorms folded into the GEMMs (models/llama.py fold_norms): its gpu tests
#             (tests/gpu/test_norm_fold_gpu.py; DETFOLD_TESTS=0 skips them, DETFOLD_K a -k filter), then decode
#             latency with the mode on, det_norm_fold_max_hidden 0 / 65536 with the CUDA GEMV on (tuning patches; DETFOLD_ROUNDS pairs,
#             default 1; DETFOLD_BASE=1 first runs the tuning file as it is: an H200's triton GEMV), and the mode off (DETFOLD_OFF=0 skips it); DETFOLD_MODELS (default llama-3.1-8b), DETFOLD_BATCHES (default "1 8")
#   detprofile kernels of a deterministic prefill + decode step (Qwen3-0.6B 64 x 256, Llama-3.1-8B 1 x 1024)
#   detblocks the invariant attention GPU tests (decode blocks: prefill bits, batch-256 time) and decode in graphs
#   detsglang bin/bench deterministic alone (SGLang's single / mixed / prefix modes, DET_SAMPLES a mode)
#   detlat    decode latency under deterministic inference, both models, batch 1 8 32 (issue 21: <= 5% at batch 1);
#             DETLAT_MODELS="qwen3-30b-a3b" for another
#   quant     quantized GEMMs: their gpu tests (QUANT_TESTS: a -k filter), then bin/bench quant (fp8 row/block,
#             DeepGEMM, NVFP4 vs bf16; QUANT_BENCH=0 skips it)
#   deepgemm  DeepGEMM built here from source against the machine's torch 2.11 (scripts/build_deepgemm.sh; carry
#             build/deep_gemm.tgz): its GPU test and the block GEMMs' (cuBLASLt, triton), then bin/bench quant --shapes deepseek-v3 with it (every block
#             kernel by rows, each first call's JIT time, whether deep_gemm imported: the block rules;
#             DG_TOKENS="32 4096" other row counts, DG_REP_MS 40)
#   dsfp8     DeepSeek-V3-5L with DeepSeek's block-FP8 config (configs/deepseek-v3-5l-fp8, dummy weights) decode
#             latency, batch 1 8 64: the served block-FP8 path (DeepGEMM from 17 rows where build/deep_gemm.tgz is
#             carried, else cuBLASLt), its start-up (warmup_s: DeepGEMM's cold compiles) and "compiled after ready"
#   fp8lat    decode latency with --quantization fp8 (per-channel e4m3 weights), both models, batch 1 8 32
#   llamafp8  Llama-3.1-8B offline 1000/1000, fp8 weights (--quantization fp8) + fp8 KV cache + fp8 math
#   spec      speculative decoding: verify rows in the decode graphs (tests/gpu/test_spec_graphs_gpu.py), then the
#             machinery: Llama-3.1-8B batch 1 (SPEC_BATCHES="1 8 32"), plain vs NGRAM k = 1 3 5 with an oracle draft
#             SPEC_SERVER_ARGS="--enable-deterministic-inference": plain and spec servers batch-invariant, so that
#             the bf16 oracle (the cached answer) holds at near ties (spec, specsweep)
#   specsweep where speculation stops paying: batch 1 8 32 64, NGRAM k = 1 3 5, an oracle spoiling 30% of its drafts
#             (every batch size at its k: --speculative-num-steps-by-batch-size= turns the default rules off)
#   specpolicy tests/gpu/test_spec_by_batch_gpu.py (plain and verify steps mixed in the graphs as the batch crosses
#             the rules), then the default --speculative-num-steps-by-batch-size (4:3,16:0) on specsweep's workload,
#             k = 5: expect ~2.4x at batch 1, ~1.6x at 8 (3 drafts), ~1.0x at 32 and 64 (plain decode steps)
#   specmla   a verify step of 2 drafts on DeepSeek-V3-5L (MLA + MoE) in the decode graphs, batch 1: its cost against
#             a plain step is "step x" = 1 / "of accept" (issue 24's MTP figure, the verify part; NGRAM oracle drafts)
#   specmladet specmla under --enable-deterministic-inference: a verify row's bits are a plain row's, so the
#             oracle (the cached answer) holds in bf16 and every step verifies 2 drafts
#   cp        context parallelism: the flash partials + LSE merge of two simulated cp ranks vs full attention at 128k
#   cpmla     MLA under context parallelism: two simulated cp ranks' latent partials merged vs mla_attend at 32k
#             (tests/gpu/test_cp_mla_gpu.py; correctness only)
#   moe       fused MoE: tests/gpu/test_moe_gpu.py, then Qwen3-30B-A3B decode latency (batch 1 8 32, ctx 1024,
#             CUDA graphs) and moeoffline, then DeepSeek-V3-5L latency (batch 1 64)
#   moetest   tests/gpu/test_moe_gpu.py only
#   moelat    Qwen3-30B-A3B decode latency only (batch 1 8 32, ctx 1024)
#   moeoffline Qwen3-30B-A3B offline, 256 x 1000/1000 (the issue's shape, beside llama8m's Llama-3.1-8B)
#   moesweep  fused MoE GEMM blocks per token count (scripts/moe_sweep.py), Qwen3-30B-A3B bf16, DeepSeek-V3 fp8-block
#             (MOESWEEP_SHAPES="qwen3-30b-a3b:none" for one)
#   nvfp4moe  NVFP4 MoE checkpoints on CUDA (tests/gpu/test_moe_nvfp4_gpu.py): experts dequantized at load, vs CPU
#   mla       MLA decode: tests/gpu/test_mla_gpu.py, then bin/bench mla (V3 shapes, heads 128/16, batch 1 8 64 128,
#             ctx 1k-32k, bf16/fp8 latent vs the copy bandwidth; tile sweep; flashinfer's MLA wrapper beside at
#             128 heads, last) ~5 min, more if flashinfer's MLA module JIT-compiles; 570 s at most
#             and tests/gpu/test_mla_flashinfer_gpu.py (flashinfer's MLA wrapper served at >= 64 heads: eager, mixed
#             and graph-replayed steps vs torch / the triton kernel, greedy tokens served; builds the MLA module first)
#   mlatest   mla's gpu tests only (no bench)
#   flashmla  bin/bench mla --flashmla: FlashMLA's dense SM90 decode (sgl-flash-mla, carried in .whl) beside ours at
#             64-token pages, and flashinfer's wrapper at --page-size (16); FLASHMLA_HEADS ("128 16"), FLASHMLA_BS
#             ("1 64 128"), FLASHMLA_CTXS ("4096 16384"), FLASHMLA_NO_FI=1 without flashinfer
#   flashmlaserve tests/gpu/test_flash_mla_gpu.py, then DeepSeek-V3-5L decode latency (batch 1 8 64) with FlashMLA
#             (the auto page size, 64) and with flashinfer's MLA wrapper (--page-size 16) on one machine;
#             FLASHMLA_CTX (1024), FLASHMLA_BS ("1 8 64"), FLASHMLA_TESTS=0 skips the tests
#   mlaserve  DeepSeek-V3-5L decode latency, batch 1 8 64 (flashinfer's MLA wrapper served at 128 heads)
#   heads     speculative EAGLE / EAGLE3 / NEXTN heads on CUDA, float32 (tests/gpu/test_spec_heads_gpu.py)
#   specgrammar constrained verify rows with grammar helpers on CUDA (tests/gpu/test_spec_grammar_gpu.py), then
#             the structured mode with --speculative-algorithm NGRAM (64 json_schema answers valid, drafts masked)
#   spectree  NGRAM draft trees on CUDA (tests/gpu/test_spec_tree_gpu.py): acceptance and K/V compaction vs CPU,
#             a tiny Llama's greedy tokens with NGRAM trees and EAGLE leaf trees (torch backend), flashinfer refused
#   sweep     batch-1 decode kernels as served (scripts/kernel_sweep.py: distinct weights / KV in a graph, PDL):
#             GEMV configs (fp8, bf16) at Llama-3.1-8B shapes, decode attention splits / blocks, MoE blocks at 1 token; SWEEP="attention gemv moe"
#             (also "a3b": Qwen3-30B-A3B's batch-1 o and qkv + norm GEMV configs; "gemm")
#   ab        decode latency of AB_MODEL (llama-3.1-8b) with AB_ARGS (--quantization fp8) at AB_BATCHES ("1 8"), the
#             tuning file as is, then with each of TUNING_PATCHES (JSON objects separated by ";", each merged over
#             configs/tuning/NVIDIA_H200.json for its run only): an A/B of tuning choices on one machine
#   aboffline llamafp8's offline run (Llama-3.1-8B fp8 weights + fp8 KV + fp8 math, 1000/1000, 256 requests) with the
#             tuning file as is, then with each of TUNING_PATCHES (as in ab)
#   abcode    an A/B of code variants on one machine: decode latency of AB_MODEL with AB_ARGS at AB_BATCHES and
#             each of AB_CTX ("1024"; a list) with the tree as is ("base"), then with each of AB_VARIANTS in turn, AB_ROUNDS (2) times
#             alternated; a variant is a directory abvar/NAME holding whole files at their repository paths, copied over
#             the tree for its runs and restored after (leave abvar/ untracked; the device tree has no git); AB_BENCH_ARGS
#             go to bin/bench latency (e.g. "--temperature 1 --top-p 0.95"), AB_TAG names the tarball. Prints a
#             table of overlapped ms a step; the result files go into one abcode-<model>-<variants>.tgz
#   pack      tar the logs into one file ($OUT returns at most 8 files)
#   cachepack the kernel caches this call compiled (triton's, flashinfer's JIT, DeepGEMM's JIT) into
#             $OUT/kernel-cache.tgz (at most 16 MiB: $OUT's limit; else the largest entries are listed). Saved here as
#             build/kernel-cache.tgz and carried, a later call starts with them (unpacked into $HOME first): a
#             fresh machine then skips the compiles its warm-ups would repeat (Llama-3.1-8B fp8: warmup_s 148.6
#             cold on an H100). Warm-ups still run before ready, and "compiled after ready" still diffs from ready
set -uo pipefail
MODES="dsfp8 detgemv detfold aboffline quick sampler samplinglat check latency qwen llama8m llama serve profile1 cache structured l2decode hostcopy det detcost detoffline detgemm quant deepgemm fp8lat llamafp8 detprofile detlat detblocks detsglang moe moetest moelat moeoffline moesweep nvfp4moe cp cpmla mla mlatest flashmla flashmlaserve mlaserve heads specnextn specnextnprofile specdraft spec specsweep specmla specmladet specmlaprofile specpolicy specpolicytest specgrammar spectree sweep ab abcode pack cachepack"
[ $# -gt 0 ] || { echo "usage: bash scripts/gpu_bench.sh MODE ... (modes: $MODES)" >&2; exit 2; }
for what in "$@"; do
  case " $MODES " in *" $what "*) ;; *) echo "gpu_bench.sh: unknown mode '$what' (modes: $MODES)" >&2; exit 2 ;; esac
done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD FLASHINFER_NO_DOWNLOAD=1 PYTHONUNBUFFERED=1 STRATA_PYTHON=python3
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# the device tree has no .git: pass STRATA_GIT_COMMIT=<commit> in the command to record it
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
# result files are named by the card that ran them (h100, h200, ...; "gpu" for another)
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -oiE 'h[0-9]{3}' | head -1 | tr 'A-Z' 'a-z')
GPU=${GPU:-gpu}
if [ -f build/kernel-cache.tgz ]; then  # the caches a previous call packed (cachepack): same GPU arch, same wheels
  tar -C "$HOME" -xzf build/kernel-cache.tgz && echo "kernel caches restored from build/kernel-cache.tgz"
fi
run() {  # name, timeout, command...
  local name=$1 t=$2; shift 2
  echo "=== $name"; local t0=$(date +%s)
  timeout "$t" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "rc=$rc in $(( $(date +%s) - t0 )) s"; grep -A14 "Result ==" "$OUT/$name.log" | head -24
  grep -A3 "compiled after ready" "$OUT/$name.log"
  [ $rc = 0 ] || { tail -40 "$OUT/$name.log"; for f in /tmp/strata-bench-*/serve.log; do [ -f "$f" ] && tail -60 "$f"; done; }
  return $rc
}
check_part() {  # K/N: tests/gpu's files in N parts of about equal test counts (greedy, largest first); the K-th
  python3 - "$1" <<'PY'
import collections, subprocess, sys
k, n = map(int, sys.argv[1].split("/"))
out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "tests/gpu", "-p",
                      "no:cacheprovider"], capture_output=True, text=True).stdout
count = collections.Counter(line.split("::")[0] for line in out.splitlines() if "::" in line)
parts = [[0, []] for _ in range(n)]
for f, c in sorted(count.items(), key=lambda fc: (-fc[1], fc[0])):
    part = min(parts, key=lambda p: p[0])
    part[0] += c
    part[1].append(f)
print(" ".join(sorted(parts[k - 1][1])))
PY
}
detoff_wants() { case " ${DETOFF_MODELS:-qwen llama} " in *" $1 "*) return 0 ;; esac; return 1; }  # detoffline's models
tuned() {  # PATCH, command...: run the command with PATCH (JSON) merged over this GPU's tuning file
  local f patch=$1; shift
  f=$(python3 -c "import torch; from engine.layers.tuning import tuning_file; print(tuning_file(torch.cuda.get_device_name()))")
  cp "$f" /tmp/tuning.orig.json
  [ -n "$patch" ] && python3 -c "import json,sys; d=json.load(open('$f')); d.update(json.loads(sys.argv[1])); json.dump(d, open('$f','w'))" "$patch"
  "$@"; local rc=$?
  cp /tmp/tuning.orig.json "$f"; return $rc
}
each_patch() {  # RUNNER: RUNNER 0 with the tuning file as is, then RUNNER i with TUNING_PATCHES' i-th merged over it
  local i=0 p patches; IFS=';' read -ra patches <<< "${TUNING_PATCHES:-}"
  for p in "" "${patches[@]}"; do echo "tuning patch $i: ${p:-none}"; tuned "$p" "$1" $i; i=$((i + 1)); done
}
llama_fp8_offline() {  # NAME [extra server args]: Llama-3.1-8B fp8 weights + fp8 KV + fp8 math, 1000/1000, 256 requests
  run "$1" 300 bin/bench offline --model configs/llama-3.1-8b --load-format dummy --num-requests 256 --input-len 1000 \
    --output-len 1000 --out "$OUT/$1-$GPU.json" --server-args "--quantization fp8 --max-running-requests 256 \
    --max-prefill-tokens 16384 --kv-cache-dtype fp8_e4m3 --attention-fp8-math ${2:-}" || fails=$((fails + 1))
}
ab_latency() {  # I: one decode-latency run of the ab mode
  local m=${AB_MODEL:-llama-3.1-8b}
  run latency-$m-ab$1 240 bin/bench latency --model configs/$m --load-format dummy --batch-sizes ${AB_BATCHES:-1 8} \
    --context-len 1024 --steps 50 --server-args="${AB_ARGS---quantization fp8}" --out "$OUT/latency-$m-ab$1-$GPU.json" \
    || fails=$((fails + 1))
  grep -A4 "batch  *ctx" "$OUT/latency-$m-ab$1.log"
}
ab_offline() { llama_fp8_offline offline-llama-3.1-8b-fp8w-ab$1; }
variant() {  # in|out NAME: copy abvar/NAME's files over the tree (originals kept in /tmp/abkeep; new files removed on out)
  local f; [ "$2" = base ] && return 0
  [ -d "abvar/$2" ] || { echo "gpu_bench.sh: no variant directory abvar/$2" >&2; return 1; }
  (cd "abvar/$2" && find . -type f) | while read -r f; do f=${f#./}
    if [ "$1" = in ]; then mkdir -p "/tmp/abkeep/$(dirname "$f")" "$(dirname "$f")"
      if [ -f "$f" ]; then cp "$f" "/tmp/abkeep/$f"; else : > "/tmp/abkeep/$f.absent"; fi; cp "abvar/$2/$f" "$f"
    elif [ -f "/tmp/abkeep/$f.absent" ]; then rm -f "$f" "/tmp/abkeep/$f.absent"; else cp "/tmp/abkeep/$f" "$f"; fi
  done
}
ab_code() {  # every variant (base first) AB_ROUNDS times, alternated; then the table and one tarball of the results
  local m=${AB_MODEL:-llama-3.1-8b} r v c dir="$OUT/abcode"; mkdir -p "$dir"
  for r in $(seq 1 "${AB_ROUNDS:-2}"); do for c in ${AB_CTX:-1024}; do for v in base ${AB_VARIANTS:?abcode needs AB_VARIANTS}; do
    variant in "$v" || { fails=$((fails + 1)); continue; }
    timeout 300 bin/bench latency --model "configs/$m" --load-format dummy --batch-sizes ${AB_BATCHES:-1 8} \
      --context-len "$c" --steps 50 ${AB_BENCH_ARGS:-} --server-args="${AB_ARGS:-}" --out "$dir/latency-$m-$v-ctx$c-$r-$GPU.json" \
      > "$dir/$v-ctx$c-$r.log" 2>&1 || { fails=$((fails + 1)); tail -20 "$dir/$v-ctx$c-$r.log"; }
    variant out "$v"
  done; done; done
  python3 - "$dir" <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    rows = json.loads(f.read_text())["figures"]["batches"]
    print(f"{f.stem:60}", "  ".join(f"b{r['batch_size']} {r['pipelined_ms_per_step']:.3f} ms" for r in rows))
PY
  tar czf "$OUT/abcode-$m-$(echo ${AB_VARIANTS} | tr ' ' '_')${AB_TAG:+-$AB_TAG}.tgz" -C "$dir" . && rm -rf "$dir"
}
moe_offline() {
  run offline-qwen3-30b-a3b 200 bin/bench offline --model configs/qwen3-30b-a3b --load-format dummy \
    --num-requests 256 --input-len 1000 --output-len 1000 \
    --server-args "--max-running-requests 256 --max-prefill-tokens 16384 --log-dir $OUT/logs-moe" \
    --out "$OUT/offline-qwen3-30b-a3b-1000-1000-$GPU.json" || fails=$((fails + 1))
  grep -h '"gpu idle"' "$OUT"/logs-moe/worker-0.log | tail -2
}
dg=(env)  # DeepGEMM built here against this torch (scripts/build_deepgemm.sh), where build/deep_gemm.tgz is carried
if [ -f build/deep_gemm.tgz ]; then
  mkdir -p /tmp/dgpkg && tar -C /tmp/dgpkg -xzf build/deep_gemm.tgz
  nv=$(python3 -c "import torch,pathlib;print(':'.join(map(str,pathlib.Path(torch.__file__).parents[1].glob('nvidia/**/lib'))))")
  dg=(env PYTHONPATH=/tmp/dgpkg:$PYTHONPATH LD_LIBRARY_PATH=$nv:${LD_LIBRARY_PATH:-})
fi
fails=0
for what in "$@"; do case $what in
  dsfp8) run latency-deepseek-v3-5l-fp8 "${DSFP8_TIMEOUT:-500}" "${dg[@]}" bin/bench latency --model configs/deepseek-v3-5l-fp8 --load-format dummy \
           --batch-sizes 1 8 64 --context-len 1024 --steps 50 --out "$OUT/latency-deepseek-v3-5l-fp8-$GPU.json" \
           || fails=$((fails + 1)); grep -A6 "batch  *ctx" "$OUT/latency-deepseek-v3-5l-fp8.log"
         python3 -c "import json,sys; f=json.load(open(sys.argv[1]))['figures']; print('startup', f['startup_s'])" \
           "$OUT/latency-deepseek-v3-5l-fp8-$GPU.json" ;;
  quick) run gpu-quick 300 python3 -m pytest -m gpu tests/gpu/test_grammar_gpu.py tests/cache/test_tier_gpu.py -q -rA \
           -p no:cacheprovider || fails=$((fails + 1)); grep -E "PASSED|FAILED|ERROR|passed|failed|Error" "$OUT/gpu-quick.log" | tail -30 ;;
  sampler) run gpu-sampler 200 python3 -m pytest tests/run/test_sampler.py -q -rA -p no:cacheprovider -k cuda \
             || fails=$((fails + 1)); grep -E "passed|failed|FAILED|Error" "$OUT/gpu-sampler.log" | tail -12
           run sampler-cost 200 python3 scripts/sampler_cost.py "$OUT/sampler-cost.json" || fails=$((fails + 1))
           cat "$OUT/sampler-cost.log" ;;
  samplinglat) for m in ${SAMPLING_MODELS:-qwen3-0.6b llama-3.1-8b}; do
             for cfg in "greedy:--temperature 0:" "qwen:--temperature 0.6 --top-k 20 --top-p 0.95:" \
                        "topp:--temperature 1 --top-p 0.95:" "detgreedy:--temperature 0:--enable-deterministic-inference" \
                        "detqwen:--temperature 0.6 --top-k 20 --top-p 0.95:--enable-deterministic-inference"; do
               IFS=: read -r tag flags sargs <<< "$cfg"
               [ "${SAMPLING_DET:-1}" = 0 ] && [ -n "$sargs" ] && continue
               case " ${SAMPLING_TAGS:-$tag} " in *" $tag "*) ;; *) continue ;; esac
               run latency-$m-$tag 240 bin/bench latency --model configs/$m --load-format dummy --batch-sizes 1 8 64 \
                 --context-len 1024 --steps 50 $flags --server-args="$sargs" --out "$OUT/latency-$m-sampling-$tag-$GPU.json" \
                 || fails=$((fails + 1))
               grep -A5 "batch  *ctx" "$OUT/latency-$m-$tag.log" | sed -n 3,5p; done; done
             # one file back for all of them ($OUT returns 8 files at most)
             (cd "$OUT" && tar czf samplinglat.tgz latency-*-sampling-*.json latency-*.log && rm -f latency-*-sampling-*.json latency-*.log) ;;
  check) files=$(check_part "${CHECK_PART:-1/1}") || { fails=$((fails + 1)); continue; }
         echo "check part ${CHECK_PART:-1/1}: $files"
         run gpu-tests 540 python3 -m pytest -m gpu $files -v -rA -p no:cacheprovider \
           --junitxml "$OUT/gpu-tests.xml" || fails=$((fails + 1)); grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/gpu-tests.log" | tail -40 ;;
  latency) for m in qwen3-0.6b llama-3.1-8b; do
            run latency-$m 200 bin/bench latency --model configs/$m --load-format dummy --batch-sizes 1 8 32 \
              --context-len 1024 --steps 50 --profile-idle --out "$OUT/latency-$m-$GPU.json" || fails=$((fails + 1))
            grep -A6 "batch  *ctx" "$OUT/latency-$m.log"; done ;;
  qwen) run offline-qwen3-0.6b 200 bin/bench offline --model configs/qwen3-0.6b --load-format dummy \
          --num-requests 256 --server-args "--max-running-requests 256 --max-prefill-tokens 16384 --log-dir $OUT/logs-qwen" \
          --out "$OUT/offline-qwen3-0.6b-$GPU.json" || fails=$((fails + 1)); grep -h '"gpu idle"' $OUT/logs-qwen/worker-0.log | tail -3 ;;
  llama8m) run offline-llama-3.1-8b-fp8math 260 bin/bench offline --model configs/llama-3.1-8b --load-format dummy \
          --num-requests 256 --input-len 1000 --output-len 1000 \
          --server-args "--max-running-requests 256 --max-prefill-tokens 16384 --kv-cache-dtype fp8_e4m3 --attention-fp8-math --log-dir $OUT/logs-llama8m" \
          --out "$OUT/offline-llama-3.1-8b-1000-1000-fp8kv-fp8math-$GPU.json" || fails=$((fails + 1))
          grep -h '"gpu idle"' $OUT/logs-llama8m/worker-0.log | tail -2 ;;
  llama) run offline-llama-3.1-8b 260 bin/bench offline --model configs/llama-3.1-8b --load-format dummy \
          --num-requests 256 --input-len 1000 --output-len 1000 \
          --server-args "--max-running-requests 256 --max-prefill-tokens 16384 --log-dir $OUT/logs-llama" \
          --out "$OUT/offline-llama-3.1-8b-1000-1000-$GPU.json" || fails=$((fails + 1)) ;;
  serve) run serve-qwen3-0.6b 150 bin/bench serve --model configs/qwen3-0.6b --load-format dummy \
          --num-requests 400 --request-rate 40 --server-args "--max-running-requests 256" \
          --out "$OUT/serve-qwen3-0.6b-$GPU.json" || fails=$((fails + 1)) ;;
  profile1) for p in ${PROFILES:-qwen3-0.6b:1:1024 llama-3.1-8b:1:1024}; do IFS=: read -r m b c f <<< "$p"
             tag=$(echo "$m-b$b-$c$f" | tr -c 'A-Za-z0-9.\n-' '-')
             run profile-$tag 200 python3 scripts/profile_decode.py configs/$m $b $c ${f//,/ } || fails=$((fails + 1))
             grep -A31 "per decode step" "$OUT/profile-$tag.log"; done ;;
  cache) rm -rf /tmp/strata-l3; run cache-llama-3.1-8b 580 bin/bench cache --model configs/llama-3.1-8b --load-format dummy \
          --prompt-len 32768 --repeat 3 --l3-dir /tmp/strata-l3 --server-args "--max-prefill-tokens 32832 --log-dir $OUT/logs-cache" \
          --out "$OUT/cache-llama-3.1-8b-32k-$GPU.json" || fails=$((fails + 1))
          grep -A8 "served by" "$OUT/cache-llama-3.1-8b.log"; grep -h '"host copies"' $OUT/logs-cache/worker-0.log | tail -3 ;;
  structured) run structured-qwen3-0.6b 300 bin/bench structured --model configs/qwen3-0.6b --load-format dummy \
          --tokenizer-from bench/tok-smollm2 --num-requests 64 --max-tokens 512 --server-args "--log-dir $OUT/logs-structured" \
          --out "$OUT/structured-qwen3-0.6b-$GPU.json" || fails=$((fails + 1))
          grep -h '"grammar timing"\|"gpu idle"' $OUT/logs-structured/worker-0.log | tail -12 ;;
  l2decode) for l2 in off on; do
            extra=""; [ $l2 = on ] && extra="--enable-hierarchical-cache"
            run offline-qwen3-0.6b-l2$l2 240 bin/bench offline --model configs/qwen3-0.6b --load-format dummy --num-requests 256 \
              --server-args "--max-running-requests 256 --max-prefill-tokens 16384 $extra --log-dir $OUT/logs-l2$l2" \
              --out "$OUT/offline-qwen3-0.6b-l2$l2-$GPU.json" || fails=$((fails + 1))
            grep -h '"gpu idle"' $OUT/logs-l2$l2/worker-0.log | tail -2; grep -h '"host copies"' $OUT/logs-l2$l2/worker-0.log | tail -2; done ;;
  det) run gpu-det 460 python3 -m pytest -m gpu tests/gpu/test_deterministic_gpu.py tests/gpu/test_deterministic_graphs_gpu.py tests/gpu/test_invariant_attention_gpu.py -q -rA -p no:cacheprovider \
         || fails=$((fails + 1)); grep -E "PASSED|FAILED|ERROR|passed|failed|Error|timing:" "$OUT/gpu-det.log" | tail -16
       ;&
  detsglang) run deterministic-qwen3-0.6b 280 bin/bench deterministic --model configs/qwen3-0.6b --load-format dummy \
         --samples "${DET_SAMPLES:-300}" --sampling "${DET_SAMPLING:-temperature}" --server-args "--enable-deterministic-inference --dtype bfloat16 --log-dir $OUT/logs-det" \
         --out "$OUT/deterministic-qwen3-0.6b-$GPU.json" || fails=$((fails + 1)); grep "distinct\|deterministic:" "$OUT/deterministic-qwen3-0.6b.log" ;;
  detcost) for det in off on; do
            run offline-qwen3-0.6b-det$det 200 bin/bench offline --model configs/qwen3-0.6b --load-format dummy --num-requests 64 \
              --input-len 256 --output-len 128 --server-args "$([ $det = on ] && echo --enable-deterministic-inference) --max-running-requests 64" \
              --out "$OUT/offline-qwen3-0.6b-det$det-$GPU.json" || fails=$((fails + 1)); done ;;
  detoffline) for det in ${DET_MODES:-off on}; do  # issue 21's cost: Qwen3-0.6B offline (256 req) and Llama-3.1-8B 1000/1000
            flag=$([ $det = on ] && echo --enable-deterministic-inference)
            ! detoff_wants qwen || run offline-qwen3-0.6b-det$det 200 bin/bench offline --model configs/qwen3-0.6b --load-format dummy --num-requests 256 \
              --server-args "$flag --max-running-requests 256 --max-prefill-tokens 16384 --log-dir $OUT/logs-qwen-det$det" \
              --out "$OUT/offline-qwen3-0.6b-256-det$det-$GPU.json" || fails=$((fails + 1))
            ! detoff_wants qwen || grep -h '"gpu idle"' $OUT/logs-qwen-det$det/worker-0.log | cut -c1-220
            ! detoff_wants llama || run offline-llama-3.1-8b-det$det 240 bin/bench offline --model configs/llama-3.1-8b --load-format dummy \
              --num-requests 256 --input-len 1000 --output-len 1000 \
              --server-args "$flag --max-running-requests 256 --max-prefill-tokens 16384" \
              --out "$OUT/offline-llama-3.1-8b-1000-1000-det$det-$GPU.json" || fails=$((fails + 1)); done ;;
  detgemm) run gpu-detgemm 300 python3 -m pytest -m gpu tests/gpu/test_invariant_gemm_gpu.py -q -rA -p no:cacheprovider \
            || fails=$((fails + 1)); grep -E "^llama|^qwen|FAILED|ERROR|passed|failed|Error" "$OUT/gpu-detgemm.log" | tail -60 ;;
  detgemv) if [ "${DETGEMV_PROBE:-1}" = 1 ]; then
             run det-gemv-probe 300 python3 scripts/det_gemv_probe.py --out "$OUT/det-gemv-probe.json" || fails=$((fails + 1))
             grep -E "TB/s|BITS|bits equal" "$OUT/det-gemv-probe.log" | grep -v " bits: " | tail -30; fi
           for m in ${DETGEMV_MODELS:-llama-3.1-8b qwen3-0.6b}; do i=0
             for p in $(for r in $(seq "${DETGEMV_ROUNDS:-2}"); do echo '{"invariant_gemv_cuda":false}' \
                        '{"invariant_gemv_cuda":true}'; done); do
               tuned "$p" run latency-$m-detgemv$i 200 bin/bench latency --model configs/$m --load-format dummy \
                 --batch-sizes 1 8 --context-len 1024 --steps 50 --server-args=--enable-deterministic-inference \
                 --out "$OUT/latency-$m-detgemv$i-$GPU.json" || fails=$((fails + 1))
               echo "$p"; grep -A4 "batch  *ctx" "$OUT/latency-$m-detgemv$i.log" | sed -n 3,4p; i=$((i + 1)); done
             run latency-$m-detoff 200 bin/bench latency --model configs/$m --load-format dummy --batch-sizes 1 8 \
               --context-len 1024 --steps 50 --out "$OUT/latency-$m-detoff-$GPU.json" || fails=$((fails + 1))
             grep -A4 "batch  *ctx" "$OUT/latency-$m-detoff.log" | sed -n 3,4p; done ;;
  detfold) if [ "${DETFOLD_TESTS:-1}" = 1 ]; then
             run gpu-detfold 300 python3 -m pytest -m gpu tests/gpu/test_norm_fold_gpu.py -q -rA -p no:cacheprovider \
               -k "${DETFOLD_K:-.}" || fails=$((fails + 1))
             grep -E "PASSED|FAILED|ERROR|passed|failed|Error" "$OUT/gpu-detfold.log" | tail -16; fi
           for m in ${DETFOLD_MODELS:-llama-3.1-8b}; do i=0
             for p in $([ "${DETFOLD_BASE:-0}" = 1 ] && echo '{}'; for r in $(seq "${DETFOLD_ROUNDS:-1}"); do
                        echo '{"det_norm_fold_max_hidden":0,"invariant_gemv_cuda":true}' \
                        '{"det_norm_fold_max_hidden":65536,"invariant_gemv_cuda":true}'; done); do
               tuned "$p" run latency-$m-detfold$i 200 bin/bench latency --model configs/$m --load-format dummy \
                 --batch-sizes ${DETFOLD_BATCHES:-1 8} --context-len 1024 --steps 50 \
                 --server-args=--enable-deterministic-inference --out "$OUT/latency-$m-detfold$i-$GPU.json" \
                 || fails=$((fails + 1))
               echo "$p"; grep -A4 "batch  *ctx" "$OUT/latency-$m-detfold$i.log" | sed -n 3,4p; i=$((i + 1)); done
             [ "${DETFOLD_OFF:-1}" = 1 ] || continue
             run latency-$m-detoff 200 bin/bench latency --model configs/$m --load-format dummy \
               --batch-sizes ${DETFOLD_BATCHES:-1 8} --context-len 1024 --steps 50 --out "$OUT/latency-$m-detoff-$GPU.json" \
               || fails=$((fails + 1))
             grep -A4 "batch  *ctx" "$OUT/latency-$m-detoff.log" | sed -n 3,4p; done ;;
  detprofile) for ma in ${DET_PROFILE:-qwen3-0.6b:64:256 llama-3.1-8b:1:1024}; do IFS=: read -r m b c d <<< "$ma"; d=${d:-det}
            run profile-$m-b$b-$d 200 python3 scripts/profile_decode.py configs/$m $b $c $([ "$d" = det ] && echo --det) || fails=$((fails + 1))
            grep -A31 "per decode step\|per run" "$OUT/profile-$m-b$b-$d.log"; done ;;
  detblocks) run gpu-detblocks 300 python3 -m pytest -m gpu tests/gpu/test_invariant_attention_gpu.py tests/gpu/test_deterministic_graphs_gpu.py tests/gpu/test_deterministic_gpu.py -q -rA -s -k "${DET_TESTS:-.}" \
           -p no:cacheprovider || fails=$((fails + 1)); grep -E "PASSED|FAILED|ERROR|passed|failed|Error|decode blocks" "$OUT/gpu-detblocks.log" | tail -16 ;;
  detlat) for m in ${DETLAT_MODELS:-qwen3-0.6b llama-3.1-8b}; do
            run latency-$m-det 200 bin/bench latency --model configs/$m --load-format dummy --batch-sizes 1 8 32 \
              --context-len 1024 --steps 50 --server-args=--enable-deterministic-inference \
              --out "$OUT/latency-$m-det-$GPU.json" || fails=$((fails + 1))
            grep -A6 "batch  *ctx" "$OUT/latency-$m-det.log"; done ;;
  quant) run gpu-quant 300 python3 -m pytest -m gpu tests/gpu/test_quant_gpu.py -q -rA -p no:cacheprovider -k "${QUANT_TESTS:-.}" \
           || fails=$((fails + 1)); grep -E "PASSED|FAILED|ERROR|passed|failed|Error" "$OUT/gpu-quant.log" | tail -12
         [ "${QUANT_BENCH:-1}" = 0 ] && continue
         run quant-gemm 400 bin/bench quant ${QUANT_SWEEP:+--sweep} --out "$OUT/quant-gemm-$GPU.json" || fails=$((fails + 1))
         grep -A60 "^copy " "$OUT/quant-gemm.log" ;;
  deepgemm) [ -f build/deep_gemm.tgz ] || { echo "deepgemm: carry build/deep_gemm.tgz (scripts/build_deepgemm.sh)"; exit 2; }
           run gpu-deepgemm 200 "${dg[@]}" python3 -m pytest -m gpu tests/gpu/test_quant_gpu.py -q -rA -p no:cacheprovider \
             -k "deepgemm or fp8_block or group_quant" || fails=$((fails + 1)); grep -E "FAILED|passed|failed" "$OUT/gpu-deepgemm.log" | tail -8
           run quant-gemm-deepseek 400 "${dg[@]}" python3 -m engine.bench quant --shapes deepseek-v3 \
             ${DG_TOKENS:+--tokens $DG_TOKENS} --rep-ms ${DG_REP_MS:-40} --out "$OUT/quant-gemm-deepseek-$GPU.json" || fails=$((fails + 1))
           grep -A80 "^copy " "$OUT/quant-gemm-deepseek.log" ;;
  fp8lat) for m in qwen3-0.6b llama-3.1-8b; do
            run latency-$m-fp8 200 bin/bench latency --model configs/$m --load-format dummy --batch-sizes 1 8 32 \
              --context-len 1024 --steps 50 --profile-idle --server-args "--quantization fp8" \
              --out "$OUT/latency-$m-fp8w-$GPU.json" || fails=$((fails + 1))
            grep -A6 "batch  *ctx" "$OUT/latency-$m-fp8.log"; done ;;
  llamafp8) llama_fp8_offline offline-llama-3.1-8b-1000-1000-fp8w-fp8kv-fp8math "--log-dir $OUT/logs-llamafp8"
          grep -h '"gpu idle"' $OUT/logs-llamafp8/worker-0.log | tail -2 ;;
  spec) run gpu-spec-graphs 200 python3 -m pytest -m gpu tests/gpu/test_spec_graphs_gpu.py -q -rA -p no:cacheprovider \
          || fails=$((fails + 1)); grep -E "PASSED|FAILED|ERROR|passed|failed|Error" "$OUT/gpu-spec-graphs.log" | tail -6
        run spec-llama-3.1-8b 500 bin/bench spec --model configs/llama-3.1-8b --load-format dummy --drafts 1 3 5 \
          --batch-sizes ${SPEC_BATCHES:-1} --prompt-len 512 --output-len 256 --server-args "${SPEC_SERVER_ARGS:-} --log-dir $OUT/logs-spec" \
          --out "$OUT/spec-llama-3.1-8b-$GPU.json" || fails=$((fails + 1)); grep -A12 "k batch" "$OUT/spec-llama-3.1-8b.log"
        grep -h '"gpu idle"\|cuda graphs' $OUT/logs-spec/worker-0.log | tail -4 ;;
  specsweep) run spec-sweep-llama-3.1-8b 400 bin/bench spec --model configs/llama-3.1-8b --load-format dummy --drafts 1 3 5 \
          --batch-sizes 1 8 32 64 --prompt-len 512 --output-len 128 --corrupt 0.3 \
          --server-args="${SPEC_SERVER_ARGS:-} --speculative-num-steps-by-batch-size=" \
          --out "$OUT/spec-sweep-llama-3.1-8b-$GPU.json" || fails=$((fails + 1)); grep -A20 "k batch" "$OUT/spec-sweep-llama-3.1-8b.log" ;;
  specpolicytest) run gpu-spec-by-batch 200 python3 -m pytest -m gpu tests/gpu/test_spec_by_batch_gpu.py -q -rA -p no:cacheprovider \
          || fails=$((fails + 1)); grep -E "PASSED|FAILED|ERROR|passed|failed|Error" "$OUT/gpu-spec-by-batch.log" | tail -6 ;;
  specpolicy) run gpu-spec-by-batch 200 python3 -m pytest -m gpu tests/gpu/test_spec_by_batch_gpu.py -q -rA -p no:cacheprovider \
          || fails=$((fails + 1)); grep -E "PASSED|FAILED|ERROR|passed|failed|Error" "$OUT/gpu-spec-by-batch.log" | tail -6
        run spec-policy-llama-3.1-8b 300 bin/bench spec --model configs/llama-3.1-8b --load-format dummy --drafts 5 \
          --batch-sizes 1 8 32 64 --prompt-len 512 --output-len 128 --corrupt 0.3 --server-args="${SPEC_SERVER_ARGS:-}" \
          --out "$OUT/spec-policy-llama-3.1-8b-$GPU.json" || fails=$((fails + 1)); grep -A10 "k batch" "$OUT/spec-policy-llama-3.1-8b.log" ;;
  specmla) run spec-deepseek-v3-5l 300 bin/bench spec --model configs/deepseek-v3-5l --load-format dummy --drafts 2 \
          --batch-sizes 1 --prompt-len 512 --output-len 128 --out "$OUT/spec-deepseek-v3-5l-$GPU.json" \
          --server-args "--log-dir $OUT/logs-specmla" || fails=$((fails + 1)); grep -A6 "k batch" "$OUT/spec-deepseek-v3-5l.log"
        grep -h '"verify step eager"\|cuda graphs' $OUT/logs-specmla/worker-0.log | tail -4 ;;
  specmladet) run spec-deepseek-v3-5l-det 300 bin/bench spec --model configs/deepseek-v3-5l --load-format dummy --drafts 2 \
          --batch-sizes 1 --prompt-len 512 --output-len 128 --out "$OUT/spec-deepseek-v3-5l-det-$GPU.json" \
          --server-args "--enable-deterministic-inference --log-dir $OUT/logs-specmladet" || fails=$((fails + 1))
        grep -A6 "k batch" "$OUT/spec-deepseek-v3-5l-det.log"; grep -h 'cuda graphs' $OUT/logs-specmladet/worker-0.log | tail -2 ;;
  specmlaprofile) STRATA_PROFILE_STEPS=${SPECMLA_PROFILE:-140:20} run spec-deepseek-v3-5l-profile 300 bin/bench spec \
          --model configs/deepseek-v3-5l --load-format dummy --drafts 2 --batch-sizes 1 --prompt-len 512 --output-len 128 \
          --out "$OUT/spec-deepseek-v3-5l-profiled-$GPU.json" --server-args "--log-dir $OUT/logs-specmlaprof" \
          || fails=$((fails + 1))  # the k = 2 server's steps 140..159 (its warm run, verify steps; 40..59 were the first run's plain ones)
        grep -h '"verify step eager"\|cuda graphs' $OUT/logs-specmlaprof/worker-0.log | tail -4
        head -40 $OUT/logs-specmlaprof/profile-rank0.txt ;;
  nvfp4moe) run gpu-nvfp4moe 300 python3 -m pytest -m gpu tests/gpu/test_moe_nvfp4_gpu.py -q -rA -p no:cacheprovider \
        || fails=$((fails + 1)); grep -E "PASSED|FAILED|ERROR|passed|failed|Error" "$OUT/gpu-nvfp4moe.log" | tail -10 ;;
  cp) run gpu-cp 200 python3 -m pytest -m gpu tests/gpu/test_cp_gpu.py -q -rA -p no:cacheprovider \
        || fails=$((fails + 1)); grep -E "PASSED|FAILED|ERROR|passed|failed|Error" "$OUT/gpu-cp.log" | tail -10 ;;
  cpmla) run gpu-cpmla 200 python3 -m pytest -m gpu tests/gpu/test_cp_mla_gpu.py -q -rA -p no:cacheprovider \
        || fails=$((fails + 1)); grep -E "PASSED|FAILED|ERROR|passed|failed|Error" "$OUT/gpu-cpmla.log" | tail -10 ;;
  moe) run gpu-moe 200 python3 -m pytest -m gpu tests/gpu/test_moe_gpu.py -q -rA -p no:cacheprovider \
         || fails=$((fails + 1)); grep -E "PASSED|FAILED|ERROR|passed|failed|Error" "$OUT/gpu-moe.log" | tail -20
       run latency-qwen3-30b-a3b 140 bin/bench latency --model configs/qwen3-30b-a3b --load-format dummy --batch-sizes 1 8 32 \
         --context-len 1024 --steps 30 --out "$OUT/latency-qwen3-30b-a3b-$GPU.json" || fails=$((fails + 1))
       grep -A6 "batch  *ctx" "$OUT/latency-qwen3-30b-a3b.log"; grep -h "cuda graphs\|runner ready" "$OUT/latency-qwen3-30b-a3b.log" | tail -3
       moe_offline
       run latency-deepseek-v3-5l 100 bin/bench latency --model configs/deepseek-v3-5l --load-format dummy --batch-sizes 1 64 \
         --context-len 1024 --steps 20 --out "$OUT/latency-deepseek-v3-5l-$GPU.json" || fails=$((fails + 1))
       grep -A4 "batch  *ctx" "$OUT/latency-deepseek-v3-5l.log" ;;
  moeoffline) moe_offline ;;
  moetest) run gpu-moe 200 python3 -m pytest -m gpu tests/gpu/test_moe_gpu.py -q -rA -p no:cacheprovider \
         || fails=$((fails + 1)); grep -E "PASSED|FAILED|ERROR|passed|failed|Error" "$OUT/gpu-moe.log" | tail -20 ;;
  moelat) run latency-qwen3-30b-a3b 140 bin/bench latency --model configs/qwen3-30b-a3b --load-format dummy --batch-sizes 1 8 32 \
         --context-len 1024 --steps 30 --out "$OUT/latency-qwen3-30b-a3b-$GPU.json" || fails=$((fails + 1))
       grep -A6 "batch  *ctx" "$OUT/latency-qwen3-30b-a3b.log" ;;
  mlaserve) run latency-deepseek-v3-5l 140 bin/bench latency --model configs/deepseek-v3-5l --load-format dummy --batch-sizes 1 8 64 \
         --context-len 1024 --steps 30 --out "$OUT/latency-deepseek-v3-5l-$GPU.json" || fails=$((fails + 1))
       grep -A5 "batch  *ctx" "$OUT/latency-deepseek-v3-5l.log"; grep -h "cuda graphs\|runner ready\|mla" "$OUT/latency-deepseek-v3-5l.log" | tail -4 ;;
  moesweep) for sq in ${MOESWEEP_SHAPES:-qwen3-30b-a3b:none deepseek-v3:fp8_block}; do
            run moe-sweep-${sq/:/-} 280 python3 scripts/moe_sweep.py --shape ${sq%:*} --quant ${sq#*:} \
              --out "$OUT/moe-sweep-${sq/:/-}-$GPU.json" || fails=$((fails + 1)); grep -E "^tokens|rules" "$OUT/moe-sweep-${sq/:/-}.log"; done ;;
  mla|mlatest) run gpu-mla 330 python3 -m pytest -m gpu tests/gpu/test_mla_gpu.py tests/gpu/test_mla_flashinfer_gpu.py -q -rA \
         -p no:cacheprovider || fails=$((fails + 1)); grep -E "PASSED|FAILED|ERROR|passed|failed|Error" "$OUT/gpu-mla.log" | tail -24
       [ $what = mlatest ] && continue
       run mla-bench 240 bin/bench mla --sweep --rep-ms 20 --out "$OUT/mla-decode-$GPU.json" || fails=$((fails + 1))
       grep -v "^ *$" "$OUT/mla-bench.log" | tail -120 ;;
  flashmla) run mla-flashmla 240 bin/bench mla --flashmla ${FLASHMLA_NO_FI:+--no-flashinfer} --heads ${FLASHMLA_HEADS:-128 16} \
             --kv-dtypes bf16 --batch-sizes ${FLASHMLA_BS:-1 64 128} --contexts ${FLASHMLA_CTXS:-4096 16384} --rep-ms 20 \
             --out "$OUT/mla-flashmla-$GPU.json" || fails=$((fails + 1))
           grep -v "^ *$" "$OUT/mla-flashmla.log" | tail -40 ;;
  flashmlaserve) if [ "${FLASHMLA_TESTS:-1}" != 0 ]; then
             run gpu-flashmla 300 python3 -m pytest -m gpu tests/gpu/test_flash_mla_gpu.py -q -rA -p no:cacheprovider \
               || fails=$((fails + 1)); grep -E "PASSED|FAILED|ERROR|passed|failed|Error" "$OUT/gpu-flashmla.log" | tail -14
           fi
           for ps in 0 16; do
             run latency-deepseek-v3-5l-ps$ps 160 bin/bench latency --model configs/deepseek-v3-5l --load-format dummy \
               --batch-sizes ${FLASHMLA_BS:-1 8 64} --context-len ${FLASHMLA_CTX:-1024} --steps 30 --server-args="--page-size $ps" \
               --out "$OUT/latency-deepseek-v3-5l-ps$ps-$GPU.json" || fails=$((fails + 1))
             grep -A5 "batch  *ctx" "$OUT/latency-deepseek-v3-5l-ps$ps.log"; grep -h "mla decode kernel" "$OUT/latency-deepseek-v3-5l-ps$ps.log" | tail -1; done ;;
  hostcopy) run hostcopy 120 python3 -m engine.bench.hostcopy cuda || fails=$((fails + 1)); cat "$OUT/hostcopy.log" ;;
  heads) run gpu-heads 300 python3 -m pytest -m gpu tests/gpu/test_spec_heads_gpu.py -q -rA -p no:cacheprovider \
           || fails=$((fails + 1)); grep -E "PASSED|FAILED|ERROR|passed|failed|Error" "$OUT/gpu-heads.log" | tail -14 ;;
  specnextn) for g in ${NEXTN_RUNS:-graphs eager}; do  # DeepSeek-V3-5L's own (random) MTP layer: a step's cost, graphs vs all eager
            run spec-nextn-deepseek-v3-5l-$g 300 bin/bench spec --model configs/deepseek-v3-5l --load-format dummy \
              --algorithm NEXTN --drafts ${NEXTN_DRAFTS:-2} --batch-sizes ${NEXTN_BS:-1 8} --prompt-len 512 --output-len 128 \
              --server-args "$([ $g = eager ] && echo --disable-cuda-graph) --log-dir $OUT/logs-nextn-$g" \
              --out "$OUT/spec-nextn-deepseek-v3-5l-$g-$GPU.json"  # exit 1 when bf16 answers differ from plain: read the table
            grep -A6 "k batch" "$OUT/spec-nextn-deepseek-v3-5l-$g.log"
            grep -h '"verify step eager"\|cuda graphs' $OUT/logs-nextn-$g/worker-0.log | tail -3; done ;;
  specnextnprofile) STRATA_PROFILE_STEPS=${NEXTN_PROFILE:-200:20} run spec-nextn-deepseek-v3-5l-profile 300 bin/bench spec \
            --model configs/deepseek-v3-5l --load-format dummy --algorithm NEXTN --drafts 2 --batch-sizes 1 --prompt-len 512 \
            --output-len 128 --out "$OUT/spec-nextn-deepseek-v3-5l-profiled-$GPU.json" \
            --server-args "--log-dir $OUT/logs-nextnprof"  # the NEXTN server's steps 200..219 (the second warm-up round)
          head -45 $OUT/logs-nextnprof/profile-rank0.txt ;;
  specdraft) for g in ${SPECDRAFT_RUNS:-graphs}; do  # Llama-3.1-8B with a random Llama-3.2-1B draft model: a step's cost
            run spec-draft-llama-3.1-8b-$g 300 bin/bench spec --model configs/llama-3.1-8b --load-format dummy \
              --algorithm STANDALONE --draft-model configs/llama-3.2-1b --drafts ${SPECDRAFT_K:-3} --batch-sizes 1 8 \
              --prompt-len 512 --output-len 128 \
              --server-args "$([ $g = eager ] && echo --disable-cuda-graph) --log-dir $OUT/logs-draft-$g" \
              --out "$OUT/spec-draft-llama-3.1-8b-$g-$GPU.json"  # exit 1 when bf16 answers differ from plain: read the table
            grep -A6 "k batch" "$OUT/spec-draft-llama-3.1-8b-$g.log"
            grep -h '"verify step eager"\|cuda graphs' $OUT/logs-draft-$g/worker-0.log | tail -3; done ;;
  spectree) run gpu-spectree 300 python3 -m pytest -m gpu tests/gpu/test_spec_tree_gpu.py -q -rA -p no:cacheprovider -k "${SPECTREE_TESTS:-.}" \
           || fails=$((fails + 1)); grep -E "PASSED|FAILED|ERROR|passed|failed|Error" "$OUT/gpu-spectree.log" | tail -8 ;;
  specgrammar) run gpu-specgrammar 240 python3 -m pytest -m gpu tests/gpu/test_spec_grammar_gpu.py -q -rA \
           -p no:cacheprovider || fails=$((fails + 1)); grep -E "PASSED|FAILED|ERROR|passed|failed|Error" "$OUT/gpu-specgrammar.log" | tail -8
         run structured-spec-qwen3-0.6b 300 bin/bench structured --model configs/qwen3-0.6b --load-format dummy \
          --tokenizer-from bench/tok-smollm2 --num-requests 64 --max-tokens 512 \
          --server-args "--speculative-algorithm NGRAM --log-dir $OUT/logs-specgrammar" \
          --out "$OUT/structured-spec-qwen3-0.6b-$GPU.json" || fails=$((fails + 1))
         grep -h '"grammar timing"\|"speculative decoding"' $OUT/logs-specgrammar/*.log | tail -12 ;;
  sweep) run kernel-sweep 560 python3 scripts/kernel_sweep.py ${SWEEP:-attention gemv moe} || fails=$((fails + 1))
         grep -E "^gemv|^gemm|^attention|^moe|^a3b|^     (current|best|rows)" "$OUT/kernel-sweep.log"; grep "^JSON " "$OUT/kernel-sweep.log" | cut -c6- \
           > "$OUT/kernel-sweep-$GPU-${STRATA_GIT_COMMIT:-unknown}.json" ;;
  ab) each_patch ab_latency ;;
  abcode) ab_code ;;
  aboffline) each_patch ab_offline ;;
  cachepack) (cd "$HOME" && tar czf /tmp/kernel-cache.tgz --ignore-failed-read .triton/cache .cache/flashinfer .deep_gemm 2>/dev/null)
          size=$(stat -c %s /tmp/kernel-cache.tgz); echo "kernel caches: $((size / 1048576)) MiB packed"
          if [ "$size" -le 16777216 ]; then mv /tmp/kernel-cache.tgz "$OUT/"
          else (cd "$HOME" && du -sm .triton/cache .cache/flashinfer/* .deep_gemm 2>/dev/null | sort -rn | head -8); fi ;;
  pack) tar czf /tmp/logs.tgz -C "$OUT" --exclude='*.json' . && find "$OUT" -mindepth 1 ! -name '*.json' -delete \
          && mv /tmp/logs.tgz "$OUT/"; ls "$OUT" ;;
esac; done
[ $fails = 0 ] || { echo "gpu_bench.sh: $fails run(s) failed" >&2; exit 1; }
