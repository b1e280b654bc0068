"""The short road: the core part of the book alone builds the engine.

A copy of the checkout keeps only the chapters of the core part (tools/parts.py), without a single generated
module, and tangles them. What a reader who stops after chapter 10 has must then be a whole engine:

* the package imports, and holds nothing that a later part builds;
* greedy decoding gives `transformers`' tokens, with chunked prefill, prefix-cache hits and preemption;
* every core chapter executes, top to bottom (in English);
* the engine, layers, models and settings stay within about 2,600 lines of code (upstream: about 1,200).

It executes chapters, so `./dev test` runs it on the chapters' side, after them (`python -m pytest
tests/core_road.py`), not in the test suite. The same file, run as a script inside the copy
(`python tests/core_road.py parity`), is the parity check.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The core package's code lines, as tools/first_cuts counts them (no blank lines, comments or docstrings): the
# issue that set it asked for "within about 2,600"; 2,155 when it was first measured.
MAX_CORE_CODE_LINES = 2600
CODE_FOLDERS = ("engine", "layers", "models")
CODE_FILES = ("config.py", "sampling_params.py", "llm.py")


def core_copy(target: Path) -> Path:
    """The checkout's files (tracked, and new ones git does not ignore) without the generated package and without
    the chapters outside the core part, copied into ``target``."""
    sys.path.insert(0, str(ROOT))
    from tools.parts import PARTS

    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                            check=True, capture_output=True, text=True).stdout.split("\0")
    core = {f"notebooks/{stem}.py" for stem in PARTS["core"]}
    for name in filter(None, listed):
        outside_core = name.startswith("notebooks/") and name.endswith(".py") and name.count("/") == 1 \
            and name not in core
        if name.startswith("nanovllm/") or outside_core or not (ROOT / name).is_file():
            continue
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target / name)
    return target


def in_copy(copy: Path, *command: str) -> subprocess.CompletedProcess:
    """Run ``command`` in the copy, with the copy's package first on the path (before the checkout's editable one)."""
    env = {**os.environ, "PYTHONPATH": str(copy), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return subprocess.run(command, cwd=copy, env=env, capture_output=True, text=True)


def code_lines_of(package: Path) -> int:
    sys.path.insert(0, str(ROOT))
    from tools.first_cuts import code_lines

    files = [p for folder in CODE_FOLDERS for p in sorted((package / folder).glob("*.py"))]
    files += [package / name for name in CODE_FILES]
    return sum(code_lines(p.read_text(encoding="utf-8")) for p in files)


def test_the_core_part_alone_builds_the_engine(tmp_path: Path) -> None:
    copy = core_copy(tmp_path / "core")
    tangled = in_copy(copy, sys.executable, "-m", "tools.tangle")
    assert tangled.returncode == 0, tangled.stdout + tangled.stderr

    sys.path.insert(0, str(ROOT))
    from tools.parts import PARTS
    from tools.tangle import exported_cells

    later = {target for cell, target, _ in exported_cells(ROOT)
             if Path(cell.chapter).stem not in PARTS["core"]} - {target for _, target, _ in exported_cells(copy)}
    modules = {p.relative_to(copy / "nanovllm").with_suffix("").as_posix().replace("/", ".")
               for p in (copy / "nanovllm").rglob("*.py")}
    assert later and not (later & modules), f"modules of later parts in the core package: {sorted(later & modules)}"

    parity = in_copy(copy, sys.executable, "tests/core_road.py", "parity")
    assert parity.returncode == 0, parity.stdout + parity.stderr
    print(parity.stdout)

    lines = code_lines_of(copy / "nanovllm")
    print(f"core: {lines} code lines in engine/, layers/, models/ and the settings (at most {MAX_CORE_CODE_LINES})")
    assert lines <= MAX_CORE_CODE_LINES

    executed = in_copy(copy, sys.executable, "-m", "tools.book", "execute", "--lang", "en",
                       "--out", str(tmp_path / "executed"))
    print(executed.stdout)
    assert executed.returncode == 0, executed.stdout[-3000:] + executed.stderr[-3000:]
    ran = sorted(p.stem for p in (tmp_path / "executed" / "en").glob("*.ipynb"))
    assert ran == sorted(PARTS["core"])


def parity() -> None:
    """Greedy tokens of the core engine against transformers', on the tiny Qwen3: chunked prefill, prefix-cache
    hits in a second round, and preemption in a pool too small for the batch."""
    import torch
    from transformers import AutoModelForCausalLM

    import nanovllm
    from nanovllm.book.tiny_models import TINY_VOCAB_SIZE, build_tiny_model
    from nanovllm.llm import LLM
    from nanovllm.sampling_params import SamplingParams

    assert Path(nanovllm.__file__).resolve().is_relative_to(Path.cwd().resolve()), nanovllm.__file__
    model_dir = build_tiny_model("qwen3")
    reference = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    rng = random.Random(0)

    def prompts(*lengths: int) -> list[list[int]]:
        return [[rng.randrange(3, TINY_VOCAB_SIZE) for _ in range(n)] for n in lengths]

    def expected(prompt: list[int]) -> list[int]:
        with torch.inference_mode():
            ids = torch.tensor([prompt])
            out = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8,
                                     do_sample=False)
        return out[0, len(prompt):].tolist()

    def check(llm: LLM, batch: list[list[int]]) -> dict[str, int]:
        seen = {"chunked": 0, "cache_hits": 0, "preempted": 0}

        def watch(event: str, data: dict) -> None:
            if event == "schedule":
                seen["chunked"] += sum(s.num_cached_tokens + s.num_scheduled_tokens < s.num_prompt_tokens
                                       for s in data["seqs"]) if data["is_prefill"] else 0
                seen["cache_hits"] += sum(len(blocks) for blocks in data["cache_hits"].values())
                seen["preempted"] += len(data["preempted"])

        llm.scheduler.observer = watch
        got = [out["token_ids"] for out in llm.generate(batch, greedy, use_tqdm=False)]
        assert got == [expected(p) for p in batch]
        return seen

    shared = prompts(12)[0]
    llm = LLM(str(model_dir), kvcache_block_size=4, num_kvcache_blocks=64, max_num_batched_tokens=16)
    first = check(llm, [shared + tail for tail in prompts(9, 3)] + prompts(21))
    second = check(llm, [shared + tail for tail in prompts(5, 2)])
    small = LLM(str(model_dir), kvcache_block_size=4, num_kvcache_blocks=12)
    tight = check(small, prompts(9, 7, 11, 6))
    assert first["chunked"] and second["cache_hits"] and tight["preempted"], (first, second, tight)
    print(f"core parity with transformers: chunked prefill {first}, prefix hits {second}, preemption {tight}")


if __name__ == "__main__" and sys.argv[1:] == ["parity"]:
    parity()
