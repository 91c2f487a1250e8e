#!/usr/bin/env bash
# DeepGEMM built from source against the GPU machine's torch (2.11, CUDA 13), here, for scripts/gpu_bench.sh
# deepgemm: every sgl-deep-gemm wheel is built for torch 2.14, whose dispatch keys and tensor layout 2.11 reads
# differently (docs/PERF.md, fifty-second session). Only the host module (_C, one C++ file, ~45 s on 2 cores)
# is compiled here; DeepGEMM JIT-compiles its kernels with nvcc on the GPU machine (it has nvcc 13.0).
# Usage: bash scripts/build_deepgemm.sh SRC TORCH CUDA_INC [OUT]
#   SRC      a DeepGEMM source tree (github.com/deepseek-ai/DeepGEMM; its python_api.cpp layout, v2.x)
#   TORCH    an unpacked torch 2.11.0+cu130 wheel's torch/ (include/ and lib/)
#   CUDA_INC the headers torch's CUDA headers include (cuda runtime, cublas, cusparse, cusolver, nvrtc: the
#            CUDA 13 toolkit's include/ and the nvidia-* wheels' nvidia/cu13/include, separated by ":")
#   OUT      default build/deep_gemm.tgz (git-ignored; carry it with .whl)
# cute and cutlass (DeepGEMM's third-party submodule, absent from a snapshot without submodules) come from an
# unpacked sgl-deep-gemm wheel's deep_gemm/include when SRC lacks them: DG_CUTLASS_FROM=<that directory>.
# PY_INC: Python 3.12's headers (the GPU machine's Python), when python3.12 is not on the PATH.
# The inputs, as the fifty-second session made them (Python 3.12's pip; the packages from the registry):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
#     torch==2.11.0 -d /tmp/t211 && unzip -q /tmp/t211/torch-*.whl 'torch/include/*' 'torch/lib/*' -d /tmp/t211
#   for p in nvidia-cublas nvidia-cusparse nvidia-cusolver nvidia-cuda-nvrtc nvidia-curand; do pip download --no-deps \
#     --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 --platform manylinux_2_27_x86_64 \
#     --platform manylinux_2_28_x86_64 $p -d /tmp/cu13; done; for w in /tmp/cu13/*.whl; do unzip -q -o $w \
#     'nvidia/*/include/*' 'nvidia/*/lib/*' -d /tmp/cu13; done   # then lib*.so -> lib*.so.13 links in its lib/
#   the source: the `fetch` tool's github:sgl-project/DeepGEMM, `git archive main | tar -x -C /tmp/dgsrc`
#   bash scripts/build_deepgemm.sh /tmp/dgsrc /tmp/t211/torch /usr/local/cuda-13.0/include:/tmp/cu13/nvidia/cu13/include
set -euo pipefail
SRC=$1 TORCH=$2 CUDA_INC=$3 OUT=${4:-build/deep_gemm.tgz}
PY_INC=${PY_INC:-$(python3.12 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')}
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
cp -r "$SRC/deep_gemm" "$work/"
for d in cute cutlass; do
  [ -d "$work/deep_gemm/include/$d" ] || cp -r "${DG_CUTLASS_FROM:?cute/cutlass missing: set DG_CUTLASS_FROM}/$d" "$work/deep_gemm/include/"
done
incs=(); IFS=: read -ra dirs <<< "$CUDA_INC"; for d in "${dirs[@]}"; do incs+=("-I$d"); [ -d "$d/cccl" ] && incs+=("-I$d/cccl"); done
libs=(); for d in "${dirs[@]}"; do [ -d "$d/../lib" ] && libs+=("-L$d/../lib"); [ -d "$d/../lib64" ] && libs+=("-L$d/../lib64"); done
c++ -std=c++17 -O2 -fPIC -shared -Wno-psabi -Wno-deprecated-declarations -D_GLIBCXX_USE_CXX11_ABI=1 \
  -DTORCH_EXTENSION_NAME=_C -DTORCH_API_INCLUDE_EXTENSION_H "${incs[@]}" -I"$work/deep_gemm/include" \
  -I"$TORCH/include" -I"$TORCH/include/torch/csrc/api/include" -I"$PY_INC" "$SRC/csrc/python_api.cpp" \
  -L"$TORCH/lib" -lc10 -ltorch -ltorch_cpu -ltorch_python -lc10_cuda -ltorch_cuda "${libs[@]}" \
  -lcudart -lnvrtc -lcublasLt -lcublas -o "$work/deep_gemm/_C.cpython-312-x86_64-linux-gnu.so"
mkdir -p "$(dirname "$OUT")"
tar -C "$work" -czf "$OUT" deep_gemm
echo "built $OUT ($(du -h "$OUT" | cut -f1))"
