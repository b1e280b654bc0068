#!/usr/bin/env bash
# Issue 17's GPU runs (one H200), one `run` call per step while the machine stays warm:
#
#   scripts/speed-gpu.sh keep            # copy the wheels carried in .fa4a/ to /tmp/keep (call 1)
#   scripts/speed-gpu.sh tests           # join and install FlashAttention 4's wheels (.fa4b/ + /tmp/keep),
#                                        # then the GPU tests of the FA4 backend and the fused q/k/v kernel
#   scripts/speed-gpu.sh bench           # engine: triton vs flash-attn in one invocation; a tree exported to
#                                        # .bench-base/nanovllm (before a change) in a second one
#   scripts/speed-gpu.sh kernels         # attention kernels with FA4 columns; decode launch sweep
#
# FlashAttention 4 is pure Python over nvidia-cutlass-dsl, whose cu13 library wheel (92 MB) is too big to travel
# with the tree in one call: it is split in two (split -b 46M), part A with some wheels in .fa4a/, part B and the
# rest in .fa4b/. Fetch them on a machine with network:
#   pip download --no-deps --pre --python-version 3.12 --only-binary=:all: --platform manylinux_2_28_x86_64 \
#     flash-attn-4 nvidia-cutlass-dsl nvidia-cutlass-dsl-libs-base nvidia-cutlass-dsl-libs-core \
#     nvidia-cutlass-dsl-libs-cu13 apache-tvm-ffi torch-c-dlpack-ext quack-kernels einops cuda-bindings
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-build/gpu}
mkdir -p "$out" /tmp/keep
export NCCL_NVLS_ENABLE=0
site=/tmp/fa4site

install_fa4() {
  [ -d "$site/flash_attn" ] && return 0
  cp .fa4b/* /tmp/keep/ 2>/dev/null
  cat /tmp/keep/cu13.part-* > /tmp/keep/nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl
  rm -f /tmp/keep/cu13.part-*
  local wheels=()
  for wheel in /tmp/keep/*.whl; do
    # Wheels of packages the machine already has (cuda-bindings, protobuf, einops) are left out.
    case $(basename "$wheel") in
      cuda_bindings-*) python3 -c "import cuda.bindings" 2>/dev/null && continue ;;
      protobuf-*) python3 -c "import google.protobuf" 2>/dev/null && continue ;;
      einops-*) python3 -c "import einops" 2>/dev/null && continue ;;
    esac
    wheels+=("$wheel")
  done
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "${wheels[@]}" 2>&1 | tail -3
}

case ${1:-} in
  keep)
    cp .fa4a/* /tmp/keep/ && ls -la /tmp/keep | tee "$out/keep.txt" ;;
  tests)
    install_fa4
    export PYTHONPATH=$PWD:$site:$site/nvidia_cutlass_dsl/dsl_packages  # what its .pth would add
    python3 -c "import flash_attn.cute as fa; print('flash_attn.cute', fa.__version__)" 2>&1 | tee "$out/fa4-import.txt"
    timeout 500 python3 -m pytest -q -p no:cacheprovider -m gpu -rs --junitxml="$out/tests.xml" \
      ${TESTS_K:+-k "$TESTS_K"} tests/test_06b_triton_attention.py tests/test_07_sampling.py tests/test_09_cuda_graphs.py \
      tests/test_10_tp_runtime.py tests/test_gpu_engine.py 2>&1 \
      | tee "$out/tests.log" | tail -40 ;;
  bench)
    install_fa4
    export PYTHONPATH=$PWD:$site:$site/nvidia_cutlass_dsl/dsl_packages  # what its .pth would add
    backends="triton"
    python3 -c "import flash_attn.cute" 2>/dev/null && backends="triton flash-attn"
    timeout 330 python3 -m nanovllm.bench --preset nano-vllm --no-peer --attention-backend $backends \
      --out "$out/bench.json" 2>&1 | tee "$out/bench.log" | grep -v "^\s*$"
    # The tree before a change, exported into .bench-base/ (git archive REV nanovllm | tar -x -C .bench-base);
    # -P: without it `python -m` puts the working folder, the current tree, ahead of PYTHONPATH.
    [ -d .bench-base/nanovllm ] && PYTHONPATH=$PWD/.bench-base timeout 200 python3 -P -m nanovllm.bench \
      --preset nano-vllm --no-peer --out "$out/bench-base.json" 2>&1 | tee "$out/bench-base.log" | grep -v "^\s*$" ;;
  kernels)
    install_fa4
    export PYTHONPATH=$PWD:$site:$site/nvidia_cutlass_dsl/dsl_packages  # what its .pth would add
    timeout 150 python3 scripts/decode_sweep.py --out "$out/sweep.json" 2>&1 | tee "$out/sweep.log"
    timeout 330 python3 -m nanovllm.bench.attention --quick --out "$out/attention.json" 2>&1 | tee "$out/attention.log" ;;
  *) echo "usage: scripts/speed-gpu.sh keep|tests|bench|kernels" >&2; exit 2 ;;
esac
