"""Chapter 12: the sampler's fast path as Triton kernels (the interpreter on a CPU, compiled on a GPU), and the runner
that samples with them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nanovllm.config import Config
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.layers import triton_attention
from nanovllm.layers.sampler import NON_FINITE
from nanovllm.layers.triton_sampler import race_chunk_kernel, race_pick_kernel, triton_temperature_sample
from tests.core.test_08_sampling import _not_numbers

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def _chi_square(tokens: torch.Tensor, logits: torch.Tensor, temperature: float) -> float:
    observed = torch.bincount(tokens.cpu(), minlength=len(logits)).double()
    expected = len(tokens) * (logits.float().cpu() / temperature).softmax(-1).double()
    return ((observed - expected) ** 2 / expected).sum().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_greedy_rows_are_torch_argmax(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 1000).to(dtype)  # chunks of 256: the fourth holds only 232 columns
    logits[1, [5, 999]] = 9.0  # a tie across the first and the last chunk: the first column wins
    logits[2, [512, 513]] = 9.0  # a tie inside a chunk
    logits[3, 999] = 20.0  # the very last column
    logits[4, :] = float("-inf")
    logits[4, 600] = 0.0  # a single finite logit
    tokens = triton_temperature_sample(logits.to(DEVICE), torch.zeros(6, device=DEVICE), block_size=256)
    assert tokens.dtype == torch.int64 and tokens.device.type == DEVICE
    assert torch.equal(tokens.cpu(), logits.float().argmax(-1))
    assert tokens.tolist()[1:5] == [5, 512, 999, 600]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_marks_rows_whose_logits_are_not_numbers(dtype: torch.dtype) -> None:
    logits = _not_numbers(dtype)  # chunks of 16: the NaN in chunk 0, the inf in the partial chunk 2
    for temperature in (0.0, 0.9):
        tokens = triton_temperature_sample(logits.to(DEVICE), torch.full((5,), temperature, device=DEVICE),
                                           block_size=16).cpu()
        assert tokens[:3].tolist() == [NON_FINITE] * 3
        assert ((tokens[3:] >= 1) & (tokens[3:] < 40)).all()
        if temperature == 0:
            assert torch.equal(tokens[3:], logits[3:].float().argmax(-1))


def test_triton_mixed_batch_greedy_rows_and_sampled_rows() -> None:
    torch.manual_seed(1)
    logits = torch.randn(8, 300)
    temperatures = torch.tensor([0.0, 0.8, 0.0, 1e-45, 0.0, 5.0, 0.0, 1.0])
    tokens = triton_temperature_sample(logits.to(DEVICE), temperatures.to(DEVICE), block_size=64).cpu()
    assert torch.equal(tokens[::2], logits[::2].argmax(-1))
    assert tokens[3] == logits[3].argmax()  # a tiny positive temperature is (nearly) greedy, and finite
    assert ((tokens >= 0) & (tokens < 300)).all()


def test_triton_race_samples_the_softmax_per_row_temperature() -> None:
    # Vocabulary 6 in chunks of 4 (the second chunk is half past the end); the most likely token is in
    # the second chunk. Even rows at T = 1, odd rows at T = 3: each half must follow its own softmax.
    torch.manual_seed(2024)
    base, n = torch.tensor([0.8, -0.3, 0.5, 0.0, -1.0, 1.2]), 600
    temperatures = torch.tensor([1.0, 3.0] * (n // 2))
    tokens = triton_temperature_sample(base.repeat(n, 1).to(DEVICE), temperatures.to(DEVICE), block_size=4).cpu()
    for start, temperature in ((0, 1.0), (1, 3.0)):
        # 5 degrees of freedom: exceeded with probability 0.001 by a correct sampler
        assert _chi_square(tokens[start::2], base, temperature) < 20.5


def test_triton_noise_is_new_every_call_and_replayed_by_manual_seed() -> None:
    flat, ones = torch.zeros(16, 64, device=DEVICE), torch.ones(16, device=DEVICE)  # every token equally likely
    torch.manual_seed(11)
    first = triton_temperature_sample(flat, ones, block_size=32)
    second = triton_temperature_sample(flat, ones, block_size=32)
    torch.manual_seed(11)
    replay = triton_temperature_sample(flat, ones, block_size=32)
    assert torch.equal(first, replay)
    assert not torch.equal(first, second)
    assert len(set(first.tolist())) > 4  # rows draw their own noise, not one shared row of it


def test_triton_bad_inputs_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"logits must be \[batch, vocab\]"):
        triton_temperature_sample(torch.randn(5), torch.ones(5))
    with pytest.raises(ValueError, match=r"temperatures must have shape \(2,\)"):
        triton_temperature_sample(torch.randn(2, 5), torch.ones(3))
    with pytest.raises(ValueError, match="no columns"):
        triton_temperature_sample(torch.randn(2, 0), torch.ones(2))
    with pytest.raises(ValueError, match="power of two"):
        triton_temperature_sample(torch.randn(2, 5), torch.ones(2), block_size=6)
    empty = triton_temperature_sample(torch.randn(0, 5, device=DEVICE), torch.ones(0, device=DEVICE))
    assert empty.shape == (0,) and empty.dtype == torch.int64
    # Without the interpreter, CPU tensors cannot reach a Triton kernel: the error says what to set.
    monkeypatch.setattr(triton_attention, "INTERPRETED", False)  # chapter 11's, shared by both kernel modules
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        triton_temperature_sample(torch.randn(2, 5), torch.ones(2))


@pytest.mark.gpu
def test_gpu_triton_sampler_on_the_qwen3_vocabulary() -> None:
    vocab = 151_936
    torch.manual_seed(0)
    logits = torch.randn(64, vocab, dtype=torch.bfloat16, device="cuda")
    tokens = triton_temperature_sample(logits, torch.tensor([0.0, 0.6] * 32, device="cuda"))
    assert torch.equal(tokens[::2], logits[::2].float().argmax(-1))
    assert ((tokens >= 0) & (tokens < vocab)).all()
    # 50,000 rows of the full vocabulary (7.6e9 draws: Philox counters beyond 2**32), five finite logits
    # placed in chunks 0, 1 and 17 and at both ends of the last, partial chunk.
    n, temperature = 50_000, 1.3
    columns = torch.tensor([3, 4_100, 70_000, 151_552, 151_935])
    base = torch.tensor([1.5, 1.0, 0.2, -0.5, -2.0]).bfloat16()
    row = torch.full((vocab,), float("-inf"), dtype=torch.bfloat16)
    row[columns] = base
    draws = triton_temperature_sample(row.cuda().repeat(n, 1), torch.full((n,), temperature, device="cuda")).cpu()
    assert set(draws.unique().tolist()) <= set(columns.tolist())
    counts = torch.stack([(draws == c).sum() for c in columns]).double()
    expected = n * (base.float() / temperature).softmax(-1).double()
    assert ((counts - expected) ** 2 / expected).sum().item() < 18.5  # 4 degrees of freedom, 99.9%


def _compiled_variants() -> int:
    return sum(len(cache[0]) for k in (race_chunk_kernel, race_pick_kernel) for cache in k.device_caches.values())


def _seed_for(condition) -> int:
    """A torch.manual_seed value after which the wrapper's seed (its first CPU draw) meets ``condition``."""
    for s in range(1000):
        torch.manual_seed(s)
        if condition(2**32 + int(torch.randint(2**62, ()))):
            return s
    raise AssertionError("no such seed in range(1000)")


@pytest.mark.gpu
def test_gpu_runner_samples_with_the_triton_kernels_compiled_at_start_up(tiny: Path) -> None:
    config = Config.from_kwargs(tiny, kvcache_block_size=16, num_kvcache_blocks=32, max_model_len=128,
                                max_num_seqs=4, enforce_eager=True, compile_small_ops=False)
    runner = ModelRunner(config)
    assert runner.sampler.sample_plain is triton_temperature_sample
    compiled = _compiled_variants()
    assert compiled >= 2
    # Later calls compile nothing new: not for another batch size, nor for a seed divisible by 16 or odd.
    vocab = config.hf_config.vocab_size
    seeds = (_seed_for(lambda seed: seed % 16 == 0), _seed_for(lambda seed: seed % 2 == 1), 0, 1)
    for batch, seed in zip((1, 3, 16, 17), seeds, strict=True):
        with torch.inference_mode():
            logits = torch.randn(batch, vocab, dtype=runner.dtype, device="cuda")
            torch.manual_seed(seed)
            tokens = runner.sampler(logits, torch.rand(batch, device="cuda"))
        assert tokens.shape == (batch,)
    assert _compiled_variants() == compiled
    runner.exit()
