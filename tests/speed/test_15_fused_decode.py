"""Chapter 15's fused decode layer: small_matmul against chapter 06's functions (Triton interpreter on a CPU,
compiled on a GPU), the layer's hook in the engine, and the setting."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from nanovllm.config import Config
from nanovllm.layers.activation import silu_and_mul
from nanovllm.layers.fused_decode import (
    FUSED_STEP_TOKENS,
    GEMV_ROWS,
    MAX_TOKENS,
    FusedDecodeLayer,
    SmallMatmulLaunch,
    choose_launch,
    fuse_decode_layers,
    gemv_block_n,
    small_matmul,
)
from nanovllm.layers.layernorm import rms_norm
from nanovllm.llm import LLM
from nanovllm.sampling_params import SamplingParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(x, weight, bias=None, residual=None, norm_weight=None, eps=1e-6, glu=False):
    """What the unfused layers compute: rms_norm (with the residual add), F.linear, silu_and_mul."""
    new_residual = x
    if norm_weight is not None:
        if residual is not None:
            x, new_residual = rms_norm(x, residual, norm_weight, eps)
        else:
            x = rms_norm(x, None, norm_weight, eps)
    y = F.linear(x, weight, bias)
    return (silu_and_mul(y) if glu else y), new_residual


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("tokens", [1, 5, MAX_TOKENS])
@pytest.mark.parametrize(
    "form", ["plain", "bias", "norm", "norm+residual", "norm+residual+glu", "glu+bias"],
)
def test_small_matmul_matches_the_unfused_layers(dtype: torch.dtype, tokens: int, form: str) -> None:
    generator = torch.Generator().manual_seed(tokens)
    # en: K and N not multiples of the tiles (130 of 128, 2 x 40 of 16): the masks are exercised.
    k, n = 130, 40
    glu = "glu" in form

    def draw(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=generator) * scale + shift).to(dtype).to(DEVICE)

    x, residual = draw(tokens, k), draw(tokens, k)
    weight = draw(2 * n if glu else n, k, scale=0.1)
    bias = draw(2 * n if glu else n) if "bias" in form else None
    norm_weight = draw(k, scale=0.2, shift=1.0) if "norm" in form else None
    kwargs = dict(residual=residual if "residual" in form else None, norm_weight=norm_weight, eps=1e-6, glu=glu)
    got, got_residual = small_matmul(x, weight, bias, **kwargs)
    want, want_residual = reference(x, weight, bias, **kwargs)
    # bfloat16 keeps 8 bits of mantissa: a few units of 2^-8 apart where the sums run in another order, and in the
    # Triton interpreter (3.7), which rounds float32 to bfloat16 toward zero, a unit more at each of its roundings.
    # So in bfloat16 the error is bounded against the output's own scale: a missing norm weight or a swapped gate
    # and up is off by the scale itself.
    scale = want.abs().max().item()
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2**-5, atol=2**-5 * scale)
    torch.testing.assert_close(got, want, **tolerance)
    if DEVICE == "cuda" or dtype == torch.float32:
        assert torch.equal(got_residual, want_residual)  # the residual add is exact: the same add in the same dtype
    else:
        # The Triton interpreter (3.7) rounds float32 to bfloat16 toward zero, not to nearest: one unit off at most.
        torch.testing.assert_close(got_residual, want_residual, rtol=2**-7, atol=0)


def test_small_matmul_refuses_what_it_cannot_do() -> None:
    weight = torch.randn(32, 64, device=DEVICE)
    with pytest.raises(ValueError, match=f"at most {MAX_TOKENS} rows"):
        small_matmul(torch.randn(MAX_TOKENS + 1, 64, device=DEVICE), weight)
    with pytest.raises(ValueError, match="norm_weight"):
        small_matmul(torch.randn(2, 64, device=DEVICE), weight, residual=torch.randn(2, 64, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous"):
        small_matmul(torch.randn(64, 2, device=DEVICE).t(), weight)


def test_small_matmul_reads_rows_of_a_wider_buffer() -> None:
    """Inputs that are column slices of wider buffers (rows further apart than their length) are read as such,
    and the new residual is a tensor of its own."""
    x, residual = torch.randn(3, 100, device=DEVICE)[:, :64], torch.randn(3, 80, device=DEVICE)[:, 8:72]
    weight, norm_weight = torch.randn(32, 64, device=DEVICE) / 8, torch.rand(64, device=DEVICE) + 0.5
    kwargs = dict(residual=residual, norm_weight=norm_weight, eps=1e-6)
    got, got_residual = small_matmul(x, weight, **kwargs)
    want, want_residual = reference(x, weight, **kwargs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got_residual, want_residual) and got_residual.is_contiguous()


def test_launch_gives_every_sm_of_a_large_gpu_work() -> None:
    """128 programs or more: Qwen3-0.6B's q/k/v (4096 columns) has them in 32-column blocks, gate/up (3072 after
    SiLU x mul) cannot split, o_proj (1024 from 2048) and down_proj (1024 from 3072) split the input in 4; a
    weight too short to split keeps whole inputs."""
    launches = [choose_launch(4096, 1024), choose_launch(3072, 1024, glu=True), choose_launch(1024, 2048),
                choose_launch(1024, 3072), choose_launch(40, 300)]
    assert [launch.split for launch in launches] == [1, 1, 4, 4, 1]
    assert {(launch.block_n, launch.block_k) for launch in launches} == {(32, 128)}
    assert choose_launch(1024, 1024).split == 4 and choose_launch(1024, 512).split == 2


def test_the_qkv_kernel_starts_early_exactly_in_the_steps_the_gemv_runs() -> None:
    """norm_rotate_store starts early (PDL) where the q/k/v GEMV ahead of it lets it: the same step sizes."""
    from nanovllm.layers.fused_qkv import EARLY_START_TOKENS

    assert EARLY_START_TOKENS == GEMV_ROWS == FUSED_STEP_TOKENS


def test_gemv_slices_fit_registers_and_fill_the_gpu() -> None:
    # Qwen3-0.6B: q/k/v and gate/up 8 columns a program, o_proj and down_proj 4 (256 programs each).
    assert [gemv_block_n(n, k, glu) for n, k, glu in
            [(4096, 1024, False), (3072, 1024, True), (1024, 2048, False), (1024, 3072, False)]] == [8, 8, 4, 4]
    # Qwen3-8B: the slice bounds the width (down_proj's 12,288 inputs leave room for one column a program)...
    assert [gemv_block_n(n, k, glu) for n, k, glu in
            [(6144, 4096, False), (12288, 4096, True), (4096, 12288, False)]] == [4, 2, 1]
    # ...and a row too long for registers goes to the tile kernel.
    assert gemv_block_n(1024, 20000, False) == 0 and gemv_block_n(40, 130, False) == 1


class _Recording:
    """Stands in for a Triton kernel: records each launch's grid, then launches the kernel."""

    def __init__(self, kernel, launched: list) -> None:
        self.kernel, self.launched = kernel, launched

    def __getitem__(self, grid):
        self.launched.append(grid)
        return self.kernel[grid]


@pytest.mark.parametrize("rows", [1, 3, 4])
@pytest.mark.parametrize("form", ["norm+residual+glu", "bias"])
def test_up_to_gemv_rows_take_the_gemv_and_agree_with_the_tile_kernel(
    form: str, rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Up to GEMV_ROWS rows: the GEMV runs (and the tile kernel does not), giving what the tile kernel gives; one row
    more takes the tile kernel."""
    import nanovllm.layers.fused_decode as fused_decode

    assert fused_decode.GEMV_ROWS == 4
    torch.manual_seed(1)
    x, residual = torch.randn(rows, 200, device=DEVICE), torch.randn(rows, 200, device=DEVICE)
    glu = "glu" in form
    weight = torch.randn(2 * 24 if glu else 24, 200, device=DEVICE) / 16
    bias = torch.randn(weight.shape[0], device=DEVICE) if "bias" in form else None
    kwargs = {}
    if glu:
        kwargs = dict(residual=residual, norm_weight=torch.rand(200, device=DEVICE) + 0.5, eps=1e-6, glu=True)
    tile, tile_residual = small_matmul(x, weight, bias, launch=SmallMatmulLaunch(), **kwargs)
    gemv_launches, tile_launches = [], []
    monkeypatch.setattr(fused_decode, "gemv_kernel", _Recording(fused_decode.gemv_kernel, gemv_launches))
    monkeypatch.setattr(fused_decode, "small_matmul_kernel", _Recording(fused_decode.small_matmul_kernel,
                                                                        tile_launches))
    got, got_residual = small_matmul(x, weight, bias, **kwargs)
    assert gemv_launches and not tile_launches
    torch.testing.assert_close(got, tile, rtol=1e-5, atol=1e-5)
    assert torch.equal(got_residual, tile_residual)
    small_matmul(torch.randn(fused_decode.GEMV_ROWS + 1, 200, device=DEVICE), weight, bias)
    assert len(gemv_launches) == 1 and tile_launches


@pytest.mark.parametrize("launch", [SmallMatmulLaunch(16, 64, 2, 1), SmallMatmulLaunch(32, 256, 8, 2)])
def test_small_matmul_gives_the_same_result_with_any_launch(launch: SmallMatmulLaunch) -> None:
    torch.manual_seed(0)
    x, residual, norm_weight = (torch.randn(4, 300, device=DEVICE), torch.randn(4, 300, device=DEVICE),
                                torch.rand(300, device=DEVICE) + 0.5)
    weight = torch.randn(2 * 48, 300, device=DEVICE) / 16
    kwargs = dict(residual=residual, norm_weight=norm_weight, eps=1e-6, glu=True)
    got, _ = small_matmul(x, weight, launch=launch, **kwargs)
    torch.testing.assert_close(got, reference(x, weight, **kwargs)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("split", [2, 3, 5])
@pytest.mark.parametrize("form", ["plain", "bias", "norm+residual"])
def test_split_k_adds_the_slices_to_what_one_program_computes(split: int, form: str) -> None:
    """Split-K (several programs per column block, each over a slice of the input, the last to arrive adding them)
    gives the unfused layers' result, again and again (the arrival counters come back to zero); with 5 splits
    of 300 inputs in tiles of 64 the last slice runs past the input and is masked."""
    torch.manual_seed(split)
    x, residual = torch.randn(5, 300, device=DEVICE), torch.randn(5, 300, device=DEVICE)
    weight = torch.randn(40, 300, device=DEVICE) / 16
    kwargs = {"bias": torch.randn(40, device=DEVICE)} if form == "bias" else {}
    if form == "norm+residual":
        kwargs = dict(residual=residual, norm_weight=torch.rand(300, device=DEVICE) + 0.5, eps=1e-6)
    expected, expected_residual = reference(x, weight, **kwargs)
    launch = SmallMatmulLaunch(block_n=16, block_k=64, num_warps=4, num_stages=2, split=split)
    for _ in range(3):
        got, got_residual = small_matmul(x, weight, launch=launch, **kwargs)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_residual, expected_residual)


def test_split_k_refuses_glu() -> None:
    x, weight = torch.randn(3, 64, device=DEVICE), torch.randn(2 * 16, 64, device=DEVICE)
    with pytest.raises(ValueError, match="SiLU needs the whole sum"):
        small_matmul(x, weight, glu=True, launch=SmallMatmulLaunch(split=2))


def test_fused_decode_setting(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # auto: on a GPU, where the one-token kernels measured faster than cuBLAS; on a CPU off (only the interpreter)
    assert Config.from_kwargs(tiny).fused_decode is (DEVICE == "cuda")
    assert Config.from_kwargs(tiny, fused_decode=True).fused_decode is True  # on a CPU: the interpreter (conftest)
    if DEVICE == "cpu":
        monkeypatch.delenv("TRITON_INTERPRET")
        with pytest.raises(ValueError, match="fused_decode=True on CPU needs the Triton interpreter"):
            Config.from_kwargs(tiny, fused_decode=True)
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="fused_decode"):
            Config.from_kwargs(tiny, fused_decode=bad)


@pytest.mark.parametrize("max_tokens", [1, MAX_TOKENS])
def test_engine_with_the_fused_layer_generates_what_it_generates_without(
    tiny_arch: Path, monkeypatch: pytest.MonkeyPatch, max_tokens: int
) -> None:
    """Greedy, float32, chunked prefill: steps of at most ``max_tokens`` tokens take the fused path, longer ones do
    not; the tokens are those of the unfused engine, and the fused path did run. One token: one prompt, so its
    decode steps have one token (the GEMV); handed 16, the layers also fuse the decode steps of 3 prompts and a
    prompt's last chunk (the tile kernel beyond GEMV_ROWS tokens)."""
    prompts = [list(range(3, 40)), [7, 8, 9], list(range(100, 121))]
    if max_tokens == 1:
        prompts = prompts[:1]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    step_tokens: list[int] = []
    fused_call = FusedDecodeLayer.__call__

    def recording_call(self, layer, positions, hidden_states, residual):
        step_tokens.append(hidden_states.shape[0])
        return fused_call(self, layer, positions, hidden_states, residual)

    monkeypatch.setattr(FusedDecodeLayer, "__call__", recording_call)
    tokens = {}
    for fused in (False, True):
        llm = LLM(str(tiny_arch), device=DEVICE, dtype="float32", fused_decode=fused, kvcache_block_size=16,
                  num_kvcache_blocks=32, max_num_batched_tokens=32, enforce_eager=True)
        layers = [m for m in llm.model_runner.model.modules() if hasattr(m, "fused_forward")]
        assert layers and all((m.fused_forward is not None) == fused for m in layers)
        if fused and max_tokens != FUSED_STEP_TOKENS:
            assert fuse_decode_layers(llm.model_runner.model, max_tokens) == len(layers)
        try:
            tokens[fused] = [o["token_ids"] for o in llm.generate(prompts, greedy, use_tqdm=False)]
        finally:
            llm.exit()
        assert bool(step_tokens) == fused and max(step_tokens, default=0) <= max_tokens
    if max_tokens > 1:
        assert max(step_tokens) > 1  # steps of several tokens did take the fused path
    assert tokens[True] == tokens[False]


def test_fused_layer_refuses_a_step_size_it_has_no_kernel_for() -> None:
    for bad in (0, MAX_TOKENS + 1):
        with pytest.raises(ValueError, match="max_tokens must be from 1 to 16"):
            FusedDecodeLayer(bad)


@pytest.mark.gpu
@pytest.mark.parametrize("max_tokens", [FUSED_STEP_TOKENS, MAX_TOKENS])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_gpu_fused_decode_with_graphs_matches_the_unfused_engine(
    kv_cache_dtype: str, max_tokens: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Qwen3-0.6B's layer shapes (2 layers), float32, CUDA graphs and async scheduling: the fused decode layer
    generates the unfused engine's greedy tokens, with the 16-bit and the 8-bit KV cache. Each prompt alone
    decodes a token a step (the GEMV, launched early inside the graph on Hopper), then all four together (the
    tile kernel in the graphs when the layers fuse steps of up to 16 tokens)."""
    import functools

    import nanovllm.layers.fused_decode as fused_decode
    from nanovllm.book.tiny_models import build_tiny_model

    # The runner imports fuse_decode_layers when it warms up: it gets this one.
    monkeypatch.setattr(fused_decode, "fuse_decode_layers",
                        functools.partial(fused_decode.fuse_decode_layers, max_tokens=max_tokens))
    model = build_tiny_model("qwen3", hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
                             num_key_value_heads=8, head_dim=128, num_hidden_layers=2, vocab_size=151936,
                             tie_word_embeddings=True)
    prompts = [[(7 * i + j) % 151000 + 3 for j in range(n)] for i, n in enumerate([5, 40, 17, 200])]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    tokens = {}
    for fused in (False, True):
        llm = LLM(str(model), dtype="float32", fused_decode=fused, kv_cache_dtype=kv_cache_dtype,
                  num_kvcache_blocks=64)
        assert llm.model_runner.graphs is not None
        layers = [m for m in llm.model_runner.model.modules() if hasattr(m, "fused_forward")]
        assert all((m.fused_forward is not None and m.fused_forward.max_tokens == max_tokens) == fused
                   for m in layers)
        tokens[fused] = [llm.generate([prompt], greedy, use_tqdm=False)[0]["token_ids"] for prompt in prompts]
        tokens[fused] += [o["token_ids"] for o in llm.generate(prompts, greedy, use_tqdm=False)]
        llm.exit()
        del llm
        torch.cuda.empty_cache()
    assert tokens[True] == tokens[False]


@pytest.mark.gpu
def test_gpu_small_matmul_on_qwen3_shapes_in_bfloat16() -> None:
    """The four matmuls of a Qwen3-0.6B decode layer, bf16, 1 and 16 tokens, against the unfused layers."""
    torch.manual_seed(0)
    for tokens in (1, 16):
        x, residual = torch.randn(tokens, 1024, device="cuda").bfloat16(), torch.randn(tokens, 1024,
                                                                                        device="cuda").bfloat16()
        norm_weight = (torch.rand(1024, device="cuda") + 0.5).bfloat16()
        for n, k, kwargs in [(4096, 1024, dict(residual=residual, norm_weight=norm_weight, eps=1e-6)),
                             (1024, 2048, {}),
                             (6144, 1024, dict(residual=residual, norm_weight=norm_weight, eps=1e-6, glu=True)),
                             (1024, 3072, {})]:
            inputs = x if k == 1024 else torch.randn(tokens, k, device="cuda").bfloat16()
            weight = (torch.randn(n, k, device="cuda") / k**0.5).bfloat16()
            got, got_residual = small_matmul(inputs, weight, **kwargs)
            want, want_residual = reference(inputs, weight, **kwargs)
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
            assert torch.equal(got_residual, want_residual)


@pytest.mark.gpu
def test_gpu_gemv_chain_replayed_in_a_graph_matches_eager() -> None:
    """Three dependent one-row matmuls (each reads the one before), launched early on Hopper (PDL), captured in a
    CUDA graph and replayed: bit for bit what the same kernels give launched one by one, so no kernel read its
    input before the kernel that writes it had finished."""
    torch.manual_seed(0)
    weights = [(torch.randn(1024, 1024, device="cuda") / 32).bfloat16() for _ in range(3)]
    norm_weight = (torch.rand(1024, device="cuda") + 0.5).bfloat16()
    x = torch.randn(1, 1024, device="cuda").bfloat16()

    def chain() -> torch.Tensor:
        h, residual = small_matmul(x, weights[0], residual=x, norm_weight=norm_weight, eps=1e-6)
        h, _ = small_matmul(h, weights[1])
        h, _ = small_matmul(h, weights[2], residual=residual, norm_weight=norm_weight, eps=1e-6)
        return h

    chain()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = chain()
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.testing.assert_close(captured, chain(), rtol=0, atol=0)
