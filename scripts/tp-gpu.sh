#!/usr/bin/env bash
# Issue 16's GPU runs: tensor parallelism that pays. Run from the repository root, one part per call
# (each stays under ten minutes); results and logs go to $OUT (else build/tp-gpu/).
#
#   scripts/tp-gpu.sh tests        # two GPUs: the TP tests marked gpu (graphs on every rank, async, stalls,
#                                  # Ctrl-C, /dev/shm) and the one-GPU engine tests
#   scripts/tp-gpu.sh bench-0.6b   # two GPUs: nano-vllm workload, Qwen3-0.6B shapes: TP=2 and TP=1, ratio
#   scripts/tp-gpu.sh bench-8b     # two GPUs: the same workload on Qwen3-8B shapes (bf16 weights drawn on GPU)
#   scripts/tp-gpu.sh profile      # two GPUs: scripts/profile_tp.py, tp1 / tp1-channel / tp2
#   scripts/tp-gpu.sh one-gpu      # one GPU: what a single H200 can check (channel + graphs + async, TP=1 figures)
#
# Needs only what the GPU machine has (torch, triton, transformers, pytest); no network.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-build/tp-gpu}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # the checkout's nanovllm
export NCCL_NVLS_ENABLE=0                          # NVLink multicast stays off on shared machines
python3 -c "import torch; print('tp-gpu:', torch.cuda.device_count(), 'x', torch.cuda.get_device_name())"

run() {  # run NAME COMMAND...: log to $out/NAME.log, keep going after a failure, report the status
  local name=$1
  shift
  echo "==> $name: $*"
  "$@" > "$out/$name.log" 2>&1
  local status=$?
  tail -40 "$out/$name.log"
  echo "==> $name: exit $status"
  ls /dev/shm > "$out/$name.dev-shm-after.txt" 2>/dev/null
  return $status
}

case "${1:-}" in
  tests)
    ls /dev/shm > "$out/dev-shm-before.txt" 2>/dev/null
    run tests timeout 580 python3 -m pytest -q -p no:cacheprovider -m gpu --junitxml="$out/gpu-tests.xml" \
      tests/test_10_tp_runtime.py tests/test_09_cuda_graphs.py tests/test_gpu_engine.py
    ;;
  bench-0.6b)
    run bench-0.6b timeout 580 python3 -m nanovllm.bench --preset nano-vllm --tensor-parallel-size 2 \
      --out "$out/bench-0.6b.json"
    ;;
  bench-8b)
    run bench-8b timeout 580 python3 -m nanovllm.bench --preset qwen3-8b --tensor-parallel-size 2 \
      --out "$out/bench-8b.json"
    ;;
  profile)
    run profile timeout 580 python3 scripts/profile_tp.py --out "$out/profile" --settings tp1,tp1-channel,tp2 \
      --trace-steps 3
    ;;
  one-gpu)
    run profile-1gpu timeout 300 python3 scripts/profile_tp.py --out "$out/profile-1gpu" --settings tp1,tp1-channel
    run tests-1gpu timeout 270 python3 -m pytest -q -p no:cacheprovider -m gpu \
      --junitxml="$out/gpu-tests-1gpu.xml" tests/test_09_cuda_graphs.py tests/test_gpu_engine.py
    ;;
  *)
    echo "usage: scripts/tp-gpu.sh tests|bench-0.6b|bench-8b|profile|one-gpu" >&2
    exit 2
    ;;
esac
