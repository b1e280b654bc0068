"""Chapter 08: greedy, temperature via the exponential race, top-k, top-p, per-request seeds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanovllm.layers.sampler import (
    NON_FINITE,
    Sampler,
    apply_top_k,
    apply_top_p,
    sampling_inputs,
    seeded_generator,
    temperature_sample,
)
from nanovllm.sampling_params import SamplingParams

sampler = Sampler()


def test_greedy_is_argmax_and_ignores_top_k_top_p() -> None:
    torch.manual_seed(0)
    logits = torch.randn(16, 100)
    out = sampler(logits, torch.zeros(16), torch.full((16,), 5), torch.full((16,), 0.3))
    assert torch.equal(out, logits.argmax(-1))
    mixed = sampler(logits, torch.tensor([0.0, 1.5] * 8))
    assert torch.equal(mixed[::2], logits[::2].argmax(-1))


def test_bf16_logits_and_tiny_temperature() -> None:
    logits = torch.randn(4, 50).bfloat16()
    out = sampler(logits, torch.full((4,), 1e-4))  # nearly greedy
    assert torch.equal(out, logits.float().argmax(-1)) and out.dtype == torch.int64


def test_race_samples_the_softmax_distribution() -> None:
    torch.manual_seed(1234)
    base, n, temperature = torch.tensor([1.5, 1.0, 0.2, -0.5, -2.0]), 50_000, 1.3
    counts = torch.bincount(sampler(base.repeat(n, 1), torch.full((n,), temperature)), minlength=5).double()
    expected = n * (base / temperature).softmax(-1).double()
    chi_square = ((counts - expected) ** 2 / expected).sum().item()
    assert chi_square < 18.5  # 4 degrees of freedom: exceeded with probability 0.001 by a correct sampler


def test_top_k_mask_and_draws() -> None:
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.0, 0.5], [5.0, 4.0, 3.0, 2.0, 1.0]])
    masked = apply_top_k(logits, torch.tensor([2, 0]))
    assert torch.isinf(masked[0]).tolist() == [True, False, True, False, True]
    assert torch.equal(masked[1], logits[1])  # k <= 0: no limit
    assert torch.equal(apply_top_k(logits, torch.tensor([5, 99])), logits)
    torch.manual_seed(0)
    n = 4000
    out = sampler(logits[:1].repeat(n, 1), torch.full((n,), 5.0), torch.full((n,), 2))
    assert set(out.tolist()) == {1, 3}  # high temperature: both survivors are drawn, nothing else


def test_top_p_keeps_smallest_set_reaching_p() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()[None].repeat(4, 1)
    kept = ~torch.isinf(apply_top_p(logits, torch.tensor([0.5, 0.8, 0.81, 0.01])))
    assert kept.tolist() == [
        [True, False, False, False],  # 0.5 reaches 0.5
        [True, True, False, False],  # 0.5 + 0.3 reaches 0.8
        [True, True, True, False],  # needs the third
        [True, False, False, False],  # always at least one
    ]
    assert not torch.isinf(apply_top_p(logits, torch.ones(4))).any()
    shuffled = logits[:, [2, 0, 3, 1]]  # the mask follows the tokens, not their index order
    assert (~torch.isinf(apply_top_p(shuffled, torch.full((4,), 0.8)))).tolist()[0] == [False, True, False, True]


def test_seed_is_independent_of_batch_composition_and_row() -> None:
    torch.manual_seed(0)
    vocab = 64
    own = torch.randn(6, vocab)  # the seeded request's logits at 6 successive positions
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=2024)

    def run(batch_size: int, row: int) -> list[int]:
        tokens = []
        for step in range(6):
            logits = torch.randn(batch_size, vocab)  # neighbours: different every time
            logits[row] = own[step]
            batch = [SamplingParams(temperature=0.5 + i) for i in range(batch_size)]
            batch[row] = params
            tokens.append(int(sampler(logits, **sampling_inputs(batch, [100 + step] * batch_size))[row]))
        return tokens

    reference = run(1, 0)
    assert run(3, 2) == reference and run(8, 5) == reference
    other = SamplingParams(temperature=1.0, top_p=0.9, seed=2025)
    draws = [int(sampler(own[:1], **sampling_inputs([other], [100]))[0]) for _ in range(3)]
    assert len(set(draws)) == 1  # the same (seed, position) always draws the same token


def test_seeded_generators_differ_by_seed_and_position() -> None:
    def noise(seed: int, position: int) -> torch.Tensor:
        return torch.empty(8).exponential_(generator=seeded_generator(seed, position))

    assert torch.equal(noise(1, 5), noise(1, 5))
    assert not torch.equal(noise(1, 5), noise(1, 6)) and not torch.equal(noise(1, 5), noise(2, 5))
    assert not torch.equal(noise(0, 1), noise(1, 0))


def test_sampling_inputs() -> None:
    inputs = sampling_inputs([SamplingParams(temperature=0), SamplingParams(top_k=4, top_p=0.5, seed=3)], [7, 9])
    assert inputs["temperatures"].tolist() == [0.0, 1.0] and inputs["top_ks"].tolist() == [0, 4]
    assert inputs["top_ps"].tolist() == [1.0, 0.5]
    assert inputs["generators"][0] is None and isinstance(inputs["generators"][1], torch.Generator)


@pytest.mark.parametrize("temperature", [1e-3, 1e-38, 1e-40, 1e-45])
def test_tiny_positive_temperatures_stay_finite_and_pick_the_argmax(temperature: float) -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0], [40.0, -40.0, 39.0, 0.0]])
    params = [SamplingParams(temperature=temperature)] * 2
    tokens = Sampler()(logits, **sampling_inputs(params, [0, 0]))
    assert tokens.tolist() == [1, 0]


def test_sampling_inputs_pass_none_for_unused_features() -> None:
    plain = sampling_inputs([SamplingParams(temperature=0.6), SamplingParams(temperature=0)], [3, 4])
    assert plain["top_ks"] is None and plain["top_ps"] is None and plain["generators"] is None
    assert plain["temperatures"].tolist() == pytest.approx([0.6, 0.0])
    only_top_p = sampling_inputs([SamplingParams(top_p=0.9), SamplingParams()], [3, 4])
    assert only_top_p["top_ks"] is None and only_top_p["generators"] is None
    assert only_top_p["top_ps"].tolist() == pytest.approx([0.9, 1.0])


def test_fast_path_draws_what_the_general_path_draws() -> None:
    # Same noise stream, same tokens: the fast path is the general path minus the unused filters.
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    temperatures = torch.tensor([0.0, 0.5, 1.0, 2.0, 0.0, 0.7])
    torch.manual_seed(7)
    fast = sampler(logits, temperatures)
    torch.manual_seed(7)
    general = sampler(logits, temperatures, top_ks=torch.zeros(6, dtype=torch.int64), top_ps=torch.ones(6))
    assert torch.equal(fast, general)
    assert fast[0] == logits[0].argmax() and fast[4] == logits[4].argmax()


def test_fast_path_is_taken_only_without_top_k_top_p_and_seeds() -> None:
    calls = []

    def counting(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
        calls.append(len(logits))
        return temperature_sample(logits, temperatures)

    probe = Sampler(counting)
    logits = torch.randn(2, 9)
    probe(logits, **sampling_inputs([SamplingParams(), SamplingParams(temperature=0)], [1, 1]))
    probe(logits, **sampling_inputs([SamplingParams(), SamplingParams(top_k=3)], [1, 1]))
    probe(logits, **sampling_inputs([SamplingParams(), SamplingParams(seed=5)], [1, 1]))
    assert calls == [2]


def _not_numbers(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows 0-2 hold no number to sample from (a NaN, a +inf, only -inf); rows 3-4 are fine (one -inf is a mask)."""
    torch.manual_seed(3)
    logits = torch.randn(5, 40)
    logits[0, 7], logits[1, 39], logits[2], logits[3, 0] = float("nan"), float("inf"), float("-inf"), float("-inf")
    return logits.to(dtype)


@pytest.mark.parametrize("path", ["fast", "top-k", "seeded"])
def test_rows_whose_logits_are_not_numbers_are_marked(path: str) -> None:
    logits = _not_numbers()
    options = {"fast": {}, "top-k": {"top_ks": torch.full((5,), 10)},
               "seeded": {"generators": [seeded_generator(1, 0)] * 5}}[path]
    for temperature in (0.0, 0.9):
        tokens = sampler(logits, torch.full((5,), temperature), **options)
        assert tokens[:3].tolist() == [NON_FINITE] * 3
        assert ((tokens[3:] >= 1) & (tokens[3:] < 40)).all()  # a real token; column 0 of row 3 is masked
        if temperature == 0:
            assert torch.equal(tokens[3:], logits[3:].argmax(-1))


def test_the_torch_sampler_module_does_not_import_triton() -> None:
    code = "import sys, nanovllm.layers.sampler; assert 'triton' not in sys.modules, 'triton imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])
