#!/usr/bin/env bash
# Download, on a machine with network, the wheels that the GPU machine lacks for serving (python -m nanovllm.serve,
# python -m nanovllm.bench.serve, and `transformers serve`, the peer): cp312 manylinux wheels, with their dependencies,
# into DIR (default .whl-serve, ignored by git). scripts/gpu-ci.sh serve installs them there, each one only if the
# machine lacks it or has a version that the others do not accept (scripts/pick_wheels.py): nothing the machine
# already has in a version that fits (pydantic, anyio, httpx... come with its huggingface-hub) is shadowed.
#
#   scripts/serve-wheels.sh [DIR]         # then carry DIR with the tree: run(..., carry=["DIR"])
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.whl-serve}
mkdir -p "$dest"
# The pins of pyproject.toml (the server's and the benchmark's), the openai client and rich: transformers serve
# imports both (transformers[serving] lists fastapi, uvicorn, pydantic, starlette, openai and rich). The fleet
# (scripts/gpu-ci.sh fleet) adds SGLang's gateway, whose launcher imports aiohttp, orjson and setproctitle, and the
# KV events' pyzmq and msgspec: about 34 MB more, most of it the gateway's one binary.
pin() { sed -n "s/^ *\"\($1==[^\"]*\)\",.*/\1/p" pyproject.toml | head -1; }
packages=("$(pin fastapi)" "$(pin uvicorn)" "$(pin prometheus-client)" "$(pin httpx)" "$(pin openai)" rich
          "$(pin sglang-router)" "$(pin pyzmq)" "$(pin msgspec)" aiohttp orjson setproctitle)
for package in "${packages[@]}"; do
  [ -n "$package" ] || { echo "serve-wheels: a pin is missing from pyproject.toml" >&2; exit 2; }
done
rm -f "$dest"/*.whl
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
  -d "$dest" "${packages[@]}" 2> >(grep -v 'is ignored' >&2)
ls "$dest"
du -sh "$dest"
