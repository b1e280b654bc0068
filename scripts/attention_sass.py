"""The paged attention kernels' machine code for an H200 (sm_90), compiled on this machine, no GPU needed.

    python scripts/attention_sass.py [--json OUT]
    python scripts/attention_sass.py --shared-memory [--json OUT]

Prints, for the decode kernel and the paged prefill kernel (one that reads its keys through the block table), each
over a 16-bit and a float8 cache (Qwen3-0.6B's heads: 2 query heads a KV head, head_dim 128, blocks of 256), the
registers a thread, the instructions of each key loop and the most frequent opcodes in them, how many one-byte
loads the loops hold, from shared memory (LDS.U8) and from global memory (LDG.E.U8), and how many shared-memory
buffers the pipeliner gave the K and V tiles (from Triton's TTGIR: one means each tile loads only after the last
one was used). Chapter 24 reads these numbers: the first float8 decode kernel loaded its values one byte at a time
from shared memory, 128 loads a thread a tile, until the cache kept them by dimension; the paged prefill then
still gathered them byte by byte from global memory, until its tiles loaded whole; and at 3 stages the decode
kept one buffer, because the block-table read that addresses a tile takes a stage of the pipeline.

With --shared-memory it compiles, for an A100, an RTX 4090 and an H200, every attention launch the engine would pick
there (``choose_prefill_launch``, ``DECODE_LAUNCH``) and prints the shared memory each takes against what a block of
that GPU may use: a launch that asks for more fails to start.

Triton compiles for any target it knows (``triton.compile`` with a ``GPUTarget``), and its wheel ships
``nvdisasm`` and ``cuobjdump``; no other tool does this job here, hence this script. The figures come from this
machine's Triton (pinned in pyproject.toml); the GPU machine's Triton may allocate a few registers differently.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path
from types import SimpleNamespace

if os.environ.get("TRITON_INTERPRET") == "1":
    raise SystemExit("attention_sass: compiling needs Triton's compiler; unset TRITON_INTERPRET")

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from nanovllm.layers import triton_attention as ta

TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
H200 = GPUTarget("cuda", 90, 32)
# GPUs the shared-memory check covers: compute capability, the shared memory a block may opt into, and SMs (as
# torch.cuda.get_device_properties reports them: major, shared_memory_per_block_optin, multi_processor_count).
GPUS = {"A100": ((8, 0), 166_912, 108), "RTX 4090": ((8, 9), 101_376, 128), "H200": ((9, 0), 232_448, 132)}
# Qwen3-0.6B: 16 query heads over 8 KV heads, head_dim 128; the engine's blocks of 256 tokens.
SHAPES = {"GROUP": 2, "HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_SIZE": 256}
# As a large batch launches it: one slice per (sequence, KV head), no early start (MANY_SPLITS).
DECODE_SHAPES = {**SHAPES, "GROUP_PAD": 16, "SPLIT": False, "PDL": False}
# The prefill as a large step launches it on an H200 (choose_prefill_launch: BLOCK_M, BLOCK_N, warps, stages).
PREFILL_LAUNCH = (128, 128, 8, 3)
# Arguments the JIT would specialize as multiples of 16 on the engine's tensors (aligned pointers, strides): the
# decode's list as chapter 24's figures were compiled; the prefill's every pointer and stride but the block
# table's (its width changes every step, so the kernels do not specialize it).
DECODE_ALIGNED = ("q_ptr", "k_cache_ptr", "v_cache_ptr", "block_tables_ptr", "context_lens_ptr", "o_ptr", "lse_ptr",
                  "k_scale_ptr", "v_scale_ptr", "stride_q_b", "stride_c_t", "stride_c_h", "stride_v_b", "stride_v_h",
                  "stride_o_b", "stride_s_b", "stride_s_h")  # fmt: skip
PREFILL_ALIGNED = tuple(name for name in ta.prefill_attention_kernel.arg_names
                        if name.endswith("_ptr") or (name.startswith("stride") and name != "stride_bt"))
INSTRUCTION = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)")
LABEL = re.compile(r"^\.(L_x_\d+):")
# A loop's K or V tiles in shared memory: !ttg.memdesc<buffers x rows x columns x type> (mutable: the pipeliner's).
TILE_BUFFERS = re.compile(r"local_alloc : \(\) -> !ttg\.memdesc<(\d+)x\d+x\d+x")
BRANCH = re.compile(r"BRA\s.*`?\(?\.(L_x_\d+)")


def argument_types(kernel: triton.JITFunction, fp8: bool) -> dict[str, str]:
    """Triton's type of every runtime argument of a kernel: bfloat16 queries and outputs, the cache's dtype,
    float32 scales and partial results, int32 tables and lengths (and every stride)."""
    cache = "*fp8e4nv" if fp8 else "*bf16"
    types = {"q_ptr": "*bf16", "o_ptr": "*bf16", "k_cache_ptr": cache, "v_cache_ptr": cache, "k_ptr": cache,
             "v_ptr": cache, "lse_ptr": "*fp32", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32",
             "block_tables_ptr": "*i32", "context_lens_ptr": "*i32", "cu_q_ptr": "*i32", "cu_k_ptr": "*i32",
             "qk_scale": "fp32"}  # fmt: skip
    return {name: types.get(name, "i32") for name in kernel.arg_names}


def compile_kernel(
    kernel: triton.JITFunction, fp8: bool, constants: dict, aligned: tuple[str, ...], options: dict,
    target: GPUTarget = H200,
) -> triton.compiler.CompiledKernel:  # fmt: skip
    """``kernel`` compiled for ``target`` with ``constants``, the ``aligned`` arguments and launch ``options``."""
    constants = {**constants, "DOT_PRECISION": "ieee", "FP8": fp8}
    signature = {**argument_types(kernel, fp8), **dict.fromkeys(constants, "constexpr")}
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    return triton.compile(ASTSource(kernel, signature, constants, attrs), target=target, options=options)


def compile_decode(fp8: bool, target: GPUTarget = H200) -> triton.compiler.CompiledKernel:
    """The decode kernel as the engine launches it on a GPU (its launch and register cap), for ``target``."""
    block_n, num_warps, num_stages = ta.DECODE_LAUNCH["fp8" if fp8 else "16-bit"]
    options = {"num_warps": num_warps, "num_stages": num_stages}
    if fp8:
        options["maxnreg"] = ta.DECODE_MAX_REGISTERS
    return compile_kernel(ta.decode_attention_kernel, fp8, {**DECODE_SHAPES, "BLOCK_N": block_n}, DECODE_ALIGNED,
                          options, target)  # fmt: skip


def compile_prefill(
    fp8: bool, launch: tuple[int, ...] = PREFILL_LAUNCH, paged: bool = True, target: GPUTarget = H200
) -> triton.compiler.CompiledKernel:
    """The prefill kernel with ``launch`` (default: as a large step launches it on an H200), its keys read through
    the block table (``paged``) or fresh, for ``target``."""
    block_m, block_n, num_warps, num_stages = launch
    constants = {**SHAPES, "PAGED": paged, "BLOCK_M": block_m, "BLOCK_N": block_n}
    return compile_kernel(ta.prefill_attention_kernel, fp8, constants, PREFILL_ALIGNED,
                          {"num_warps": num_warps, "num_stages": num_stages}, target)  # fmt: skip


def _tool(name: str, cubin: bytes, *args: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        return subprocess.run([str(TOOLS / name), *args, file.name], capture_output=True, text=True, check=True).stdout


def registers(compiled: triton.compiler.CompiledKernel) -> int:
    usage = _tool("cuobjdump", compiled.asm["cubin"], "--dump-resource-usage")
    return int(re.search(r"REG:(\d+)", usage).group(1))


def loops(sass: str) -> list[list[str]]:
    """The opcodes of each loop (a branch back to an earlier label), in order of address."""
    labels: dict[str, int] = {}
    instructions: list[tuple[int, str, str]] = []  # (address, opcode, line)
    pending = None
    for line in sass.splitlines():
        if label := LABEL.match(line.strip()):
            pending = label.group(1)
        elif match := INSTRUCTION.match(line):
            address = int(match.group(1), 16)
            if pending is not None:
                labels[pending], pending = address, None
            instructions.append((address, match.group(2), line))
    found = []
    for address, _, line in instructions:
        branch = BRANCH.search(line)
        if branch and labels.get(branch.group(1), address) < address:
            start = labels[branch.group(1)]
            found.append([opcode for at, opcode, _ in instructions if start <= at <= address])
    return found


def summary(kernel: str, fp8: bool) -> dict:
    compiled = (compile_decode if kernel == "decode" else compile_prefill)(fp8)
    key_loops = loops(_tool("nvdisasm", compiled.asm["cubin"], "-c"))
    opcodes = collections.Counter(op for loop in key_loops for op in loop)
    return {
        "kernel": kernel,
        "cache": "float8" if fp8 else "16-bit",
        "registers": registers(compiled),
        "tile_buffers": min(int(n) for n in TILE_BUFFERS.findall(compiled.asm["ttgir"])),
        "loop_instructions": [len(loop) for loop in key_loops],
        "one_byte_shared_loads": opcodes["LDS.U8"],
        "one_byte_global_loads": sum(count for op, count in opcodes.items() if op.startswith("LDG") and
                                     op.endswith(".U8")),
        "top_opcodes": collections.Counter(op.split(".")[0] for op in opcodes.elements()).most_common(10),
    }


def shared_memory() -> list[dict]:
    """For each GPU of GPUS, the shared memory of every attention launch the engine picks there, and its limit."""
    rows = []
    for gpu, ((major, minor), limit, sms) in GPUS.items():
        target = GPUTarget("cuda", 10 * major + minor, 32)
        props = SimpleNamespace(major=major, shared_memory_per_block_optin=limit, multi_processor_count=sms)
        fp8s = (False, True) if (major, minor) >= (8, 9) else (False,)  # float8 needs compute capability 8.9
        # The prefill, on a small grid and a large one: fresh keys (16-bit only) and keys read through the table.
        for launch in dict.fromkeys(ta.choose_prefill_launch(props, 128, torch.bfloat16, programs)
                                    for programs in (0, 1 << 30)):
            for paged, fp8 in [(False, False), *((True, fp8) for fp8 in fp8s)]:
                compiled = compile_prefill(fp8, launch, paged, target)
                rows.append({"gpu": gpu, "kernel": "prefill, " + ("paged" if paged else "fresh"), "fp8": fp8,
                             "launch": launch, "shared": compiled.metadata.shared, "limit": limit})
        for fp8 in fp8s:
            launch = ta.DECODE_LAUNCH["fp8" if fp8 else "16-bit"]
            rows.append({"gpu": gpu, "kernel": "decode", "fp8": fp8, "launch": launch,
                         "shared": compile_decode(fp8, target).metadata.shared, "limit": limit})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    parser.add_argument("--shared-memory", action="store_true",
                        help="the shared memory of the launches the engine picks on an A100, an RTX 4090, an H200")
    args = parser.parse_args()
    if args.shared_memory:
        rows = shared_memory()
        for row in rows:
            print(f"{row['gpu']}: {row['kernel']}, {'float8' if row['fp8'] else '16-bit'} cache, launch "
                  f"{row['launch']}: {row['shared']:,} bytes of shared memory, of {row['limit']:,} a block may use")
        if args.json:
            args.json.write_text(json.dumps(rows, indent=2))
        return
    rows = [summary(kernel, fp8) for kernel in ("decode", "prefill") for fp8 in (False, True)]
    for row in rows:
        print(f"{row['kernel']}, {row['cache']} cache: {row['registers']} registers a thread, "
              f"{row['tile_buffers']} buffer(s) a K or V tile; key loops of "
              f"{', '.join(map(str, row['loop_instructions']))} instructions, one-byte loads: "
              f"{row['one_byte_shared_loads']} shared (LDS.U8), {row['one_byte_global_loads']} global (LDG.E.U8); "
              "most frequent: " + ", ".join(f"{op} {count}" for op, count in row["top_opcodes"]))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
