"""Chapter 26: Qwen3-MoE against transformers (greedy, token for token) on tiny random MoE models, the router, the
fixed-shape path a CUDA graph captures, tensor parallelism over gloo, and what the rest of the engine must leave
alone in a sparse layer."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from nanovllm.book.tiny_models import TINY_VOCAB_SIZE, build_tiny_model
from nanovllm.config import check_tensor_parallel_size
from nanovllm.llm import LLM
from nanovllm.models.loader import ModelLoadError
from nanovllm.models.qwen3_moe import Qwen3MoeForCausalLM, SparseMoeBlock, is_sparse_layer
from nanovllm.models.registry import get_model_class
from nanovllm.sampling_params import SamplingParams

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
# Expert counts, top-k, renormalization and which layers are sparse: a spread of Qwen3-MoE configs.
VARIANTS = {
    "8x2-norm": {},
    "4x1": {"num_experts": 4, "num_experts_per_tok": 1},
    "6x3-raw": {"num_experts": 6, "num_experts_per_tok": 3, "norm_topk_prob": False},
    "dense-first": {"num_hidden_layers": 3, "mlp_only_layers": [0]},
    "every-second": {"num_hidden_layers": 4, "decoder_sparse_step": 2},
}


def prompts_of(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, TINY_VOCAB_SIZE) for _ in range(n)] for n in lengths]


def hf_greedy(path: Path, prompts: list[list[int]]) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                 min_new_tokens=MAX_TOKENS, do_sample=False)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs


def generated(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def tiny_moe() -> Path:
    return build_tiny_model("qwen3_moe")


@pytest.fixture(scope="module")
def reference(tiny_moe: Path) -> dict[str, list]:
    prompts = prompts_of([1, 4, 9, 17, 33])
    return {"prompts": prompts, "tokens": hf_greedy(tiny_moe, prompts)}


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_tokens_match_transformers_across_moe_configs(variant: str) -> None:
    path = build_tiny_model("qwen3_moe", **VARIANTS[variant])
    prompts = prompts_of([2, 7, 20], seed=1)
    llm = LLM(str(path), kvcache_block_size=4, num_kvcache_blocks=64)
    try:
        assert generated(llm, prompts) == hf_greedy(path, prompts)
    finally:
        llm.exit()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("regime", ["chunked", "preempting", "prefix-hits"])
def test_greedy_tokens_match_under_chunking_preemption_and_prefix_hits(tiny_moe: Path, reference, regime: str,
                                                                       async_scheduling: bool) -> None:
    settings = {"chunked": {"max_num_batched_tokens": 8, "max_num_seqs": 3}, "preempting": {"num_kvcache_blocks": 16},
                "prefix-hits": {}}[regime]
    llm = LLM(str(tiny_moe), kvcache_block_size=4, async_scheduling=async_scheduling,
              **{"num_kvcache_blocks": 128, **settings})
    hits: list[int] = []
    try:
        if regime == "prefix-hits":
            generated(llm, reference["prompts"])
            llm.scheduler.observer = lambda event, data: hits.extend(
                len(blocks) for blocks in data["cache_hits"].values()) if event == "schedule" else None
        assert generated(llm, reference["prompts"]) == reference["tokens"]
        assert (sum(hits) > 0) == (regime == "prefix-hits")
    finally:
        llm.exit()


def test_forked_samples_share_the_prompt_and_decode_as_one(tiny_moe: Path, reference) -> None:
    """n = 2 forks after the prefill (the shared last block copied on the first write): both greedy samples are the
    tokens of the prompt alone."""
    llm = LLM(str(tiny_moe), kvcache_block_size=4, num_kvcache_blocks=64)
    try:
        outputs = llm.generate(reference["prompts"][2:4], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                                         ignore_eos=True, n=2), use_tqdm=False)
        assert [[s["token_ids"] for s in o["outputs"]] for o in outputs] == [[t, t] for t in reference["tokens"][2:4]]
    finally:
        llm.exit()


def test_tensor_parallel_ranks_give_the_tokens_of_one_process(tiny_moe: Path, reference) -> None:
    """TP=2 over gloo: each rank holds half of every expert's width; one all-reduce per sparse block."""
    llm = LLM(str(tiny_moe), tensor_parallel_size=2, kvcache_block_size=4, num_kvcache_blocks=64)
    try:
        assert generated(llm, reference["prompts"]) == reference["tokens"]
    finally:
        llm.exit()


def random_block(seed: int, **sizes: int | bool) -> SparseMoeBlock:
    torch.manual_seed(seed)
    block = SparseMoeBlock(16, 8, **sizes)
    for param in block.parameters():
        torch.nn.init.normal_(param, std=0.3)
    return block


def test_route_keeps_the_top_k_renormalized_largest_first() -> None:
    block = random_block(0, num_experts=6, top_k=3, norm_topk_prob=True)
    x = torch.randn(5, 16)
    weights, chosen = block.route(x)
    probs = torch.softmax(block.gate(x), dim=-1)
    assert chosen.shape == (5, 3) and torch.allclose(weights.sum(-1), torch.ones(5))
    assert torch.equal(chosen, probs.topk(3).indices) and (weights[:, :-1] >= weights[:, 1:]).all()
    block.norm_topk_prob = False
    raw, _ = block.route(x)
    assert torch.allclose(raw, probs.topk(3).values)
    with pytest.raises(ValueError, match="num_experts_per_tok must be from 1 to num_experts"):
        SparseMoeBlock(16, 8, num_experts=4, top_k=5, norm_topk_prob=True)


def test_the_fixed_shape_path_equals_the_chosen_experts_loop() -> None:
    """What a CUDA graph captures (every expert on every token, weighted) against the eager loop."""
    block = random_block(1, num_experts=8, top_k=2, norm_topk_prob=True)
    x = torch.randn(11, 16)
    weights, chosen = block.route(x)
    torch.testing.assert_close(block.every_expert(x, weights, chosen), block.chosen_experts(x, weights, chosen))
    # And the loop is the definition: each token, its k experts, weighted.
    rows = [sum(w * block.expert_rows(e, x[t : t + 1])[0] for w, e in zip(weights[t], chosen[t].tolist(), strict=True))
            for t in range(11)]
    torch.testing.assert_close(block(x), torch.stack(rows))


def test_sparse_layers_follow_the_config() -> None:
    config = SimpleNamespace(num_experts=8, decoder_sparse_step=2, mlp_only_layers=[3])
    assert [i for i in range(6) if is_sparse_layer(config, i)] == [1, 5]
    assert not any(is_sparse_layer(SimpleNamespace(num_experts=0, decoder_sparse_step=1, mlp_only_layers=[]), i)
                   for i in range(4))
    assert get_model_class(["Qwen3MoeForCausalLM"]) is Qwen3MoeForCausalLM


def test_the_fused_decode_layer_leaves_sparse_layers_alone(tiny_moe: Path) -> None:
    """Its kernels know a dense gated MLP: a layer with experts keeps its own path (the dense layers of a MoE
    model still get it)."""
    from nanovllm.layers.fused_decode import fuse_decode_layers

    path = build_tiny_model("qwen3_moe", num_hidden_layers=3, mlp_only_layers=[1])
    llm = LLM(str(path), kvcache_block_size=4, num_kvcache_blocks=32)
    try:
        model = llm.model_runner.model
        assert fuse_decode_layers(model) == 1
        assert [layer.fused_forward is not None for layer in model.model.layers] == [False, True, False]
    finally:
        llm.exit()


def test_tensor_parallel_size_must_divide_the_expert_width() -> None:
    config = SimpleNamespace(num_attention_heads=8, num_key_value_heads=4, intermediate_size=64, vocab_size=512,
                             moe_intermediate_size=30)
    check_tensor_parallel_size(config, 2)
    with pytest.raises(ValueError, match="does not divide moe_intermediate_size=30"):
        check_tensor_parallel_size(config, 4)


def test_a_checkpoint_missing_an_expert_is_refused_by_name(tiny_moe: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    for file in tiny_moe.iterdir():
        if file.is_file() and file.suffix != ".safetensors":
            (broken / file.name).write_bytes(file.read_bytes())
    weights = load_file(str(tiny_moe / "model.safetensors"))
    assert "model.layers.0.mlp.experts.5.up_proj.weight" in weights and "model.layers.0.mlp.gate.weight" in weights
    del weights["model.layers.0.mlp.experts.5.up_proj.weight"]
    save_file(weights, str(broken / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"experts\.5\.up_proj"):
        LLM(str(broken), kvcache_block_size=4, num_kvcache_blocks=16)


# ---- the fused kernels (the Triton interpreter on a CPU, compiled on a GPU) ----

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter gets 16-bit dots right only through float32 (fused_moe upcasts there): float16 checks that path.
KERNEL_DTYPES = [torch.float32, torch.float16] if DEVICE == "cpu" else [torch.float32, torch.bfloat16]


def stacked(block: SparseMoeBlock) -> tuple[torch.Tensor, torch.Tensor]:
    from nanovllm.models.qwen3_moe import FusedExperts

    fused = FusedExperts(block)
    return fused.w13, fused.w2


def routing(tokens: int, num_experts: int, top_k: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(tokens)]).to(DEVICE)


@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_align_by_expert_sorts_every_pair_once_in_tiles_of_one_expert(tokens: int) -> None:
    from nanovllm.layers.fused_moe import align_by_expert

    num_experts, top_k, block_m = 6, 2, 4
    chosen = routing(tokens, num_experts, top_k, seed=tokens)
    rows, tile_expert = align_by_expert(chosen, num_experts, block_m)
    pairs = tokens * top_k
    # Shapes from the token count alone: the worst case, rounded up to whole tiles.
    assert len(rows) == -(-(pairs + num_experts * (block_m - 1)) // block_m) * block_m
    assert len(tile_expert) == len(rows) // block_m
    used = rows[rows < pairs]
    assert sorted(used.tolist()) == list(range(pairs)) and ((rows == pairs) | (rows < pairs)).all()
    flat = chosen.flatten()
    for tile, expert in enumerate(tile_expert.tolist()):
        in_tile = rows[tile * block_m:(tile + 1) * block_m]
        in_tile = in_tile[in_tile < pairs]
        if expert == num_experts:
            assert len(in_tile) == 0
        else:
            assert (flat[in_tile] == expert).all()
    assert set(tile_expert.tolist()) - {num_experts} == set(flat.tolist())


@pytest.mark.parametrize(("tokens", "num_experts", "top_k", "block_m"),
                         [(1, 128, 8, 16), (16, 128, 8, 16), (5, 6, 2, 4), (13, 8, 2, 16), (3, 60, 4, 16)])
def test_the_one_program_sort_equals_align_by_expert(tokens: int, num_experts: int, top_k: int, block_m: int) -> None:
    """Rows and tile experts identical, up to the limit (16 tokens of top-8 over Qwen3-30B-A3B's 128 experts)."""
    from nanovllm.layers.fused_moe import align_by_expert, align_in_one_program

    chosen = routing(tokens, num_experts, top_k, seed=tokens)
    for got, expected in zip(align_in_one_program(chosen, num_experts, block_m),
                             align_by_expert(chosen, num_experts, block_m), strict=True):
        assert torch.equal(got, expected)
    # Every token on one expert: one long run, every other expert's run empty.
    same = torch.full((20, 1), 7, device=DEVICE)
    for got, expected in zip(align_in_one_program(same, 8, 4), align_by_expert(same, 8, 4), strict=True):
        assert torch.equal(got, expected)


def test_sort_by_expert_takes_one_program_up_to_its_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    from nanovllm.layers import fused_moe

    limit = fused_moe.ONE_PROGRAM_PAIRS
    small, large = routing(limit // 8, 128, 8, seed=1), routing(limit // 8 + 1, 128, 8, seed=2)
    expected = fused_moe.align_by_expert(small, 128, 16)
    with pytest.raises(ValueError, match=f"at most {limit} pairs"):
        fused_moe.align_in_one_program(large, 128, 16)

    def refused(*args: object) -> None:
        raise AssertionError("align_by_expert ran")

    monkeypatch.setattr(fused_moe, "align_by_expert", refused)
    assert all(map(torch.equal, fused_moe.sort_by_expert(small, 128, 16), expected))
    with pytest.raises(AssertionError, match="align_by_expert ran"):
        fused_moe.sort_by_expert(large, 128, 16)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize(("num_experts", "top_k", "tokens"), [(8, 2, 1), (8, 2, 13), (6, 3, 33), (4, 1, 7), (8, 4, 40)])
def test_fused_moe_matches_the_chosen_experts_loop(dtype: torch.dtype, num_experts: int, top_k: int,
                                                   tokens: int) -> None:
    from nanovllm.layers.fused_moe import fused_moe

    block = random_block(tokens, num_experts=num_experts, top_k=top_k, norm_topk_prob=True).to(DEVICE, dtype)
    x = torch.randn(tokens, 16, device=DEVICE, dtype=dtype)
    weights, chosen = block.route(x)
    expected = block.chosen_experts(x, weights, chosen)
    w13, w2 = stacked(block)
    got = fused_moe(x, w13, w2, weights, chosen, block_m=16, block_n=16, block_k=16)
    tolerance = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)


def test_one_expert_for_every_token_and_bad_shapes() -> None:
    from nanovllm.layers.fused_moe import fused_moe

    block = random_block(5, num_experts=4, top_k=1, norm_topk_prob=True).to(DEVICE)
    x = torch.randn(20, 16, device=DEVICE)
    weights = torch.ones(20, 1, device=DEVICE)
    chosen = torch.full((20, 1), 2, device=DEVICE)
    w13, w2 = stacked(block)
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, chosen, block_m=16, block_n=16, block_k=16),
                               block.expert_rows(2, x))
    with pytest.raises(ValueError, match="do not fit"):
        fused_moe(x, w13, w2[:, :8], weights, chosen)


def test_fused_experts_hold_the_weights_once_and_give_transformers_tokens(tiny_moe: Path, reference) -> None:
    from nanovllm.models.qwen3_moe import fuse_moe_layers

    llm = LLM(str(tiny_moe), kvcache_block_size=4, num_kvcache_blocks=64)
    try:
        model = llm.model_runner.model
        assert fuse_moe_layers(model) == 2
        block = model.model.layers[0].mlp
        assert all(expert.gate_up_proj.weight.data_ptr() == block.fused_experts.w13[index].data_ptr()
                   for index, expert in enumerate(block.experts))
        prompts = reference["prompts"][:3]
        assert generated(llm, prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)) == [
            tokens[:4] for tokens in reference["tokens"][:3]]
    finally:
        llm.exit()


@pytest.mark.gpu
def test_fused_moe_replays_in_a_cuda_graph() -> None:
    """Its shapes depend on the token count alone: a captured graph gives the eager result for new routing."""
    from nanovllm.layers.fused_moe import fused_moe

    block = random_block(3, num_experts=8, top_k=2, norm_topk_prob=True).to("cuda", torch.bfloat16)
    w13, w2 = stacked(block)
    x = torch.randn(16, 16, device="cuda", dtype=torch.bfloat16)
    weights, chosen = block.route(x)
    fused_moe(x, w13, w2, weights, chosen)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w13, w2, weights, chosen)
    new_x = torch.randn_like(x)
    new_weights, new_chosen = block.route(new_x)
    x.copy_(new_x), weights.copy_(new_weights), chosen.copy_(new_chosen)
    graph.replay()
    torch.testing.assert_close(out, fused_moe(new_x, w13, w2, new_weights, new_chosen))
    torch.testing.assert_close(out, block.chosen_experts(new_x, new_weights, new_chosen), atol=3e-2, rtol=3e-2)


def test_weights_load_into_experts_stacked_before_loading(tiny_moe: Path) -> None:
    """What a GPU engine does (it stacks the experts as the model is built): the loaders copy each checkpoint
    tensor into its view of the stacks, so the stacks hold the checkpoint's experts."""
    from nanovllm.models.loader import load_model, read_model_dir
    from nanovllm.models.qwen3_moe import fuse_moe_layers

    model = Qwen3MoeForCausalLM(read_model_dir(tiny_moe))
    assert fuse_moe_layers(model) == 2
    load_model(model, tiny_moe)
    checkpoint = load_file(str(tiny_moe / "model.safetensors"))
    block = model.model.layers[1].mlp
    for index in (0, block.num_experts - 1):
        prefix = f"model.layers.1.mlp.experts.{index}."
        gate_up = torch.cat([checkpoint[prefix + "gate_proj.weight"], checkpoint[prefix + "up_proj.weight"]])
        assert torch.equal(block.fused_experts.w13[index], gate_up)
        assert torch.equal(block.fused_experts.w2[index], checkpoint[prefix + "down_proj.weight"])
        assert block.experts[index].down_proj.weight.data_ptr() == block.fused_experts.w2[index].data_ptr()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_fused_experts_work_with_the_8_bit_kv_cache(tiny_moe: Path, device: str) -> None:
    """The experts never touch the KV cache: with an 8-bit cache the fused kernels give the loop's tokens (the
    Triton interpreter on a CPU; the GPU's default path, under CUDA graphs, on a GPU)."""
    from nanovllm.bench.moe import counting_experts
    from nanovllm.models.qwen3_moe import fuse_moe_layers

    prompts = prompts_of([3, 12, 26], seed=2)
    outputs = {}
    for fused in (False, True):
        with counting_experts(fused):
            llm = LLM(str(tiny_moe), kvcache_block_size=16, num_kvcache_blocks=32, kv_cache_dtype="fp8",
                      device=device, dtype="float32")
        try:
            if fused and device == "cpu":
                assert fuse_moe_layers(llm.model_runner.model) == 2
            outputs[fused] = generated(llm, prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        finally:
            llm.exit()
    assert outputs[True] == outputs[False]


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "loop"])
def test_the_gpu_engine_gives_transformers_tokens_through_its_graphs(tiny_moe: Path, reference, fused: bool) -> None:
    """On a GPU a Qwen3-MoE model is built with its experts stacked (the fused kernels, the default) and its decode
    steps replay CUDA graphs; float32, so that no kernel's rounding stands between it and transformers."""
    from nanovllm.bench.moe import counting_experts

    with counting_experts(fused):
        llm = LLM(str(tiny_moe), kvcache_block_size=16, num_kvcache_blocks=64, device="cuda", dtype="float32")
    try:
        blocks = [module for module in llm.model_runner.model.modules() if isinstance(module, SparseMoeBlock)]
        assert all((block.fused_experts is not None) == fused for block in blocks) and len(blocks) == 2
        assert llm.model_runner.graphs is not None
        assert generated(llm, reference["prompts"]) == reference["tokens"]
        assert sum(int(block.touched[:, 1].sum()) for block in blocks) > 0  # decode steps ran (and were counted)
    finally:
        llm.exit()
    assert Qwen3MoeForCausalLM.fused_experts_on_gpu


@pytest.mark.parametrize("variant", ["8x2-norm", "dense-first", "every-second"])
def test_the_benchmark_counts_the_parameters_the_engine_builds(variant: str) -> None:
    """bench.engine.model_params, layer by layer (the sparse layers' router and experts through MLP_RULES), equals
    the model's own count: the dense-style bound reads every expert."""
    from nanovllm.bench.engine import model_params, weight_bytes_per_step

    path = build_tiny_model("qwen3_moe", **VARIANTS[variant])
    llm = LLM(str(path), kvcache_block_size=4, num_kvcache_blocks=16)
    try:
        hf_config, model = llm.config.hf_config, llm.model_runner.model
        assert model_params(hf_config) == sum(param.numel() for param in model.parameters())
        embed = hf_config.vocab_size * hf_config.hidden_size
        assert weight_bytes_per_step(hf_config, 4) == 4 * (model_params(hf_config) - embed - hf_config.hidden_size)
    finally:
        llm.exit()


# ---- counting the experts a decode step reads, and python -m nanovllm.bench --moe ----


def test_a_block_counts_the_experts_of_decode_steps_only_and_skips_padding_rows() -> None:
    from nanovllm.bench.moe import counting_experts
    from nanovllm.layers.context import reset_context, set_context

    with counting_experts():
        block = random_block(4, num_experts=8, top_k=2, norm_topk_prob=True)
    chosen = torch.tensor([[1, 2], [2, 5], [3, 4]])
    try:
        set_context(True)
        block.count_step(chosen)
        assert int(block.touched.sum()) == 0
        # The third row is a graph's padding row: context length 0. A step of 2 tokens, 3 experts.
        set_context(False, context_lens=torch.tensor([7, 3, 0]))
        block.count_step(chosen)
        block.count_step(chosen[:1])
        assert block.touched[2].tolist() == [3, 1] and block.touched[1].tolist() == [2, 1]
        assert int(block.touched[:, 0].sum()) == 5 and int(block.touched[:, 1].sum()) == 2
    finally:
        reset_context()
    assert SparseMoeBlock(16, 8, num_experts=4, top_k=1, norm_topk_prob=True).touched is None


def test_the_device_count_equals_a_count_on_the_host(tiny_moe: Path) -> None:
    """Each block's own count, over a run's decode steps, against the experts its routing chose, counted by hooks."""
    from nanovllm.bench.moe import counting_experts
    from nanovllm.layers.context import get_context

    with counting_experts():
        llm = LLM(str(tiny_moe), kvcache_block_size=4, num_kvcache_blocks=64)
    try:
        blocks = [m for m in llm.model_runner.model.modules() if isinstance(m, SparseMoeBlock)]
        host = []
        hooks = [block.register_forward_hook(lambda module, inputs, output: host.append(
            0 if get_context().is_prefill else len(module.route(inputs[0])[1].unique()))) for block in blocks]
        generated(llm, prompts_of([3, 9, 14], seed=5))
        for hook in hooks:
            hook.remove()
        assert sum(int(block.touched[:, 0].sum()) for block in blocks) == sum(host) > 0
    finally:
        llm.exit()


def test_the_moe_benchmark_holds_a_run_to_both_bounds_on_a_cpu(tmp_path: Path, capsys) -> None:
    from nanovllm.bench.moe import main

    out = tmp_path / "moe.json"
    assert main(["--device", "cpu", "--num-seqs", "4", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "this CPU (the figures and the bound are the CPU's)" in printed and "router-aware bound" in printed
    report = json.loads(out.read_text())
    reads = report["expert_reads"]
    assert reads["sparse_layers"] == 2 and reads["num_experts"] == 8 and reads["decode_steps"] > 0
    assert 2 / 8 <= reads["share"] <= 1
    # As the batch drains: a step of one token reads its 2 experts of 8 in each layer; of four, at most 8.
    by_tokens = {int(tokens): share for tokens, share in reads["by_tokens"].items()}
    assert by_tokens[1] == 2 / 8 and max(by_tokens) <= 4 and all(share <= 1 for share in by_tokens.values())
    assert "as the batch drains" in printed
    assert report["router_bound_tokens_per_s"] >= report["dense_bound_tokens_per_s"] > 0
    # All four fit the cache at once: the run needed no more steps than the bound counts.
    assert report["router_bound_at_run_steps_tokens_per_s"] == pytest.approx(report["router_bound_tokens_per_s"])
    assert "sequences decoded at once" not in printed
    # A dense model has nothing to count: refused by name.
    assert main(["--device", "cpu", "--num-seqs", "2", "--model", str(build_tiny_model("qwen3"))]) == 2
    assert "has no sparse layers" in capsys.readouterr().err


def test_the_router_aware_bound_at_more_steps_is_lower_by_the_weights_of_the_extra_steps() -> None:
    """Where the KV cache holds fewer sequences than the workload, a run needs more decode steps than the bound
    counts: each extra step reads the step's weights (the measured share of the experts) once more."""
    from nanovllm.bench.engine import make_workload, weight_bytes_per_step
    from nanovllm.bench.moe import ExpertReads, router_aware_bound
    from nanovllm.models.loader import read_model_dir

    hf_config = read_model_dir(build_tiny_model("qwen3_moe"))
    workload = make_workload(4, (8, 16), (5, 9), vocab_size=hf_config.vocab_size, seed=0)
    reads = ExpertReads(decode_steps=20, touched=40, sparse_layers=2, num_experts=8, by_tokens={})
    bandwidth = 1e9
    _, as_counted = router_aware_bound(workload, hf_config, 4, reads, bandwidth, float("inf"))
    steps = max(workload.output_lens) - 1
    _, same = router_aware_bound(workload, hf_config, 4, reads, bandwidth, float("inf"), steps)
    _, more = router_aware_bound(workload, hf_config, 4, reads, bandwidth, float("inf"), steps + 12)
    assert same == pytest.approx(as_counted) and as_counted > more
    experts = 2 * 3 * hf_config.hidden_size * hf_config.moe_intermediate_size * 8 * 4
    step_bytes = weight_bytes_per_step(hf_config, 4) - experts * (1 - reads.share)
    extra_seconds = workload.num_output_tokens / more - workload.num_output_tokens / as_counted
    assert extra_seconds == pytest.approx(12 * step_bytes / bandwidth)


def test_the_bound_at_once_reads_each_step_at_its_own_batch_not_at_the_mean_of_a_smaller_run() -> None:
    """A run whose cache held fewer sequences at a time read a smaller share of the experts in most of its steps.
    The bound that lets all sequences decode at once reads each of its steps at that step's own token count (more
    tokens, more experts); at the run's mean share it would be optimistic."""
    from nanovllm.bench.engine import make_workload
    from nanovllm.bench.moe import ExpertReads, router_aware_bound
    from nanovllm.models.loader import read_model_dir

    hf_config = read_model_dir(build_tiny_model("qwen3_moe"))
    # Four sequences of nine tokens: all at once, every one of the 8 decode steps carries four tokens.
    workload = make_workload(4, (8, 16), (9, 9), vocab_size=hf_config.vocab_size, seed=0)
    # The run read all the experts at four tokens, but spent most of its 20 steps at one or two: a mean of 0.4.
    run = ExpertReads(decode_steps=20, touched=128, sparse_layers=2, num_experts=8, by_tokens={1: 0.25, 2: 0.5, 4: 1.0})
    dense, at_once = router_aware_bound(workload, hf_config, 4, run, 1e9, float("inf"))
    _, at_the_mean = router_aware_bound(workload, hf_config, 4, run, 1e9, float("inf"), 8)
    assert run.share == pytest.approx(0.4) and run.share_at(4) == 1.0 and run.share_at(3) == 1.0
    assert at_once == pytest.approx(dense.tokens_per_s) and at_the_mean > 1.1 * at_once
    # Nothing counted by tokens: the run's mean stands in for every count.
    assert ExpertReads(1, 1, 1, 8, {}).share_at(5) == 1 / 8
