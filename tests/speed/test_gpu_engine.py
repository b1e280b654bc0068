"""The engine end to end on CUDA: triton backend vs torch backend vs transformers, greedy.

Marked ``gpu`` and skipped without CUDA; ``scripts/gpu-ci.sh`` runs them on the H200.
"""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from nanovllm.book.tiny_models import build_tiny_model
from nanovllm.llm import LLM
from nanovllm.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu

# Qwen3-0.6B's attention and MLP layout (16 query heads, 8 KV heads, head_dim 128, hidden 1024,
# vocabulary 151936) with 2 layers instead of 28: the kernels see the real shapes, the test stays short.
QWEN3_06B_LAYOUT = dict(
    hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
    num_hidden_layers=2, vocab_size=151936, max_position_embeddings=40960, tie_word_embeddings=True,
)  # fmt: skip
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def hf_greedy(model_dir: Path, batch: list[list[int]]) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    outputs = []
    with torch.inference_mode():
        for prompt in batch:
            ids = torch.tensor([prompt], device="cuda")
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=GREEDY.max_tokens,
                                 min_new_tokens=GREEDY.max_tokens, do_sample=False)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs


@pytest.mark.parametrize(
    ("kind", "overrides", "vocab"),
    [("qwen3", {}, 512), ("llama", {}, 512), ("qwen3", QWEN3_06B_LAYOUT, 151936)],
    ids=["tiny-qwen3", "tiny-llama", "qwen3-0.6b-layout"],
)
@pytest.mark.parametrize(
    "regime",
    [
        dict(kvcache_block_size=16, num_kvcache_blocks=256),
        dict(kvcache_block_size=16, num_kvcache_blocks=256, max_num_batched_tokens=40),  # chunked prefill
        dict(kvcache_block_size=16, num_kvcache_blocks=9),  # preemption
    ],
    ids=["plain", "chunked", "preemption"],
)
def test_triton_and_torch_backends_match_transformers(kind: str, overrides: dict, vocab: int, regime: dict) -> None:
    model_dir = build_tiny_model(kind, **overrides)
    batch = prompts(vocab, [1, 17, 33, 64, 5, 48])
    reference = hf_greedy(model_dir, batch)
    for backend in ("triton", "torch"):
        llm = LLM(str(model_dir), device="cuda", dtype="float32", attention_backend=backend, enforce_eager=True,
                  compile_small_ops=False, **regime)
        got = [o["token_ids"] for o in llm.generate(batch, GREEDY, use_tqdm=False)]
        assert got == reference, f"{backend} backend differs from transformers"
        del llm
        torch.cuda.empty_cache()


def test_auto_backend_on_cuda_is_triton_and_bf16_runs_end_to_end() -> None:
    model_dir = build_tiny_model("qwen3", **QWEN3_06B_LAYOUT)
    llm = LLM(str(model_dir), device="cuda")
    assert llm.config.attention_backend == "triton" and llm.config.dtype in ("bfloat16", "float16")
    outputs = llm.generate(prompts(151936, [30, 200, 7]), SamplingParams(temperature=0.6, max_tokens=20,
                                                                          ignore_eos=True), use_tqdm=False)
    assert [len(o["token_ids"]) for o in outputs] == [20, 20, 20]


def test_parallel_sampling_with_graphs_and_async_scheduling_matches_transformers() -> None:
    """n = 3 greedy samples of each prompt, forked after one prefill, all equal transformers' greedy
    completion: on CUDA with decode graphs, asynchronous scheduling and the Triton kernels. The KV cache
    starts as NaN, so a copy-on-write copy that is skipped or lands in the wrong block poisons a sample."""
    model_dir = build_tiny_model("qwen3")
    batch = prompts(512, [17, 33, 5, 48])  # 48 tokens end on a block boundary: its samples need no copy
    reference = hf_greedy(model_dir, batch)
    llm = LLM(str(model_dir), device="cuda", dtype="float32", kvcache_block_size=16, num_kvcache_blocks=64,
              compile_small_ops=False)
    assert llm.model_runner.graphs is not None and llm.config.async_scheduling is True
    llm.model_runner.kv_cache.fill_(float("nan"))
    outputs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=3), use_tqdm=False)
    for output, expected in zip(outputs, reference, strict=True):
        assert [sample["token_ids"] for sample in output["outputs"]] == [expected] * 3
    pool = llm.scheduler.block_manager
    assert pool.num_free_blocks == pool.num_blocks


FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None and \
    importlib.util.find_spec("flash_attn.cute") is not None


@pytest.mark.skipif(not FLASH_ATTN, reason="needs FlashAttention 4 (pip install --pre flash-attn-4)")
def test_flash_attn_backend_generates_what_the_triton_backend_generates() -> None:
    """bf16 at Qwen3-0.6B's layout with everything on (CUDA graphs, async scheduling, compiled small ops): prefix
    hits (the second call repeats the first's prompts), chunked prefill, n = 2 forks copying a shared block on write.

    Across backends, bf16 rounds differently and a random model's top two
    logits are often close, so one flipped argmax changes the rest of that request: the test asks that the tokens
    agree, request by request, for at least half of their length before the first difference (a broken backend
    agrees on almost nothing), and prints the figure."""
    model_dir = build_tiny_model("qwen3", **QWEN3_06B_LAYOUT)
    batch = prompts(151936, [1, 17, 300, 700, 256, 513])
    runs = {}
    for backend in ("triton", "flash-attn"):
        llm = LLM(str(model_dir), device="cuda", dtype="bfloat16", attention_backend=backend,
                  max_num_batched_tokens=512, kvcache_block_size=256)
        assert llm.config.attention_backend == backend
        first = llm.generate(batch, GREEDY, use_tqdm=False)
        again = llm.generate(batch, GREEDY, use_tqdm=False)  # prefix-cache hits on every full block
        forks = llm.generate(batch[:3], SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True, n=2, seed=5),
                             use_tqdm=False)
        runs[backend] = [o["token_ids"] for o in first + again] + [s["token_ids"] for o in forks for s in o["outputs"]]
        llm.exit()
        del llm
        torch.cuda.empty_cache()
    pairs = list(zip(runs["triton"], runs["flash-attn"], strict=True))
    common = sum(next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x)) for x, y in pairs)
    total = sum(len(x) for x, _ in pairs)
    print(f"flash-attn vs triton: {common} of {total} tokens agree before each request's first difference")
    assert common >= 0.5 * total, (common, total)


def test_flash_attn_backend_refuses_float32_before_loading_anything() -> None:
    from nanovllm.config import Config

    with pytest.raises(ValueError, match="attention_backend='flash-attn' computes in 16 bits"):
        Config.from_kwargs(str(build_tiny_model("qwen3")), attention_backend="flash-attn", dtype="float32")
