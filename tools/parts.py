"""The book's parts: which chapter belongs to which, in reading order.

*Core* builds what nano-vllm does, and builds it whole: the core chapters alone tangle into an engine that
gives `transformers`' tokens (tests/core_road.py checks exactly that in a copy of the checkout). *Speed*
makes that engine fast, *beyond* makes it serve and adds what nano-vllm lacks. An appendix that the core
chapters need belongs to core (appendix A's player draws their animations, appendix D builds the helpers
their cells use); the others stand apart.

    python -m tools.book parts      # one line per part
"""

from __future__ import annotations

from pathlib import Path

# One tuple of chapter names (file stems) per part, in reading order.
PARTS: dict[str, tuple[str, ...]] = {
    "core": (
        "00_tour", "01_sequence", "02_block_manager", "03_prefix_caching", "04_scheduler", "05_parallel_sampling",
        "06_model", "07_attention", "08_sampling", "09_model_runner", "10_engine", "A_visualization", "D_the_book",
    ),
    "speed": (
        "11_triton_attention", "12_triton_sampler", "13_attention_benchmarks", "14_cuda_graphs", "15_fused_decode",
        "16_tensor_parallel", "17_tp_runtime", "17b_tp_across_machines", "18_async_scheduling",
        "19_benchmark",
    ),
    "beyond": (
        "20_robustness", "21_serving", "22_openai_server", "23_serving_benchmark", "24_fp8_kv_cache",
        "25_speculative_decoding", "25b_speculation_measured", "26_mixture_of_experts", "27_kv_events", "28_fleet",
        "29_structured_output", "29b_tool_calls", "29c_grammar_workers", "C_live_page",
    ),
    "appendix": ("B_from_nano_vllm",),
}

# What each site calls a part, in its language.
TITLES = {
    "en": {"core": "Core: what nano-vllm does", "speed": "Speed: making it fast",
           "beyond": "Beyond: serving, and what nano-vllm lacks", "appendix": "Appendices"},
    "zh": {"core": "核心：nano-vllm 做的事", "speed": "速度：让它变快", "beyond": "更远：服务，以及 nano-vllm 没有的",
           "appendix": "附录"},
}


def part_of(chapter: str) -> str:
    """The part that ``chapter`` (a file stem, such as "04_scheduler") belongs to; KeyError for a stranger."""
    for part, chapters in PARTS.items():
        if chapter in chapters:
            return part
    raise KeyError(f"{chapter} belongs to no part: add it to tools/parts.py")


def reading_position(chapter: str) -> tuple[int, str]:
    """Where ``chapter`` (a file stem) comes in reading order: part by part, then by name. The appendices of a
    part come with it (appendix D's helpers are read with the core chapters, before chapter 11); a chapter that
    belongs to no part (a test's toy book) sorts by its name alone."""
    for index, chapters in enumerate(PARTS.values()):
        if chapter in chapters:
            return index, f"{chapters.index(chapter):04d}"
    return len(PARTS), chapter


def chapters_of(part: str, notebooks: Path) -> list[Path]:
    """The chapter files of ``part`` in the folder ``notebooks``, in reading order."""
    return [notebooks / f"{stem}.py" for stem in PARTS[part]]
