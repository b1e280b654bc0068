"""Chapter 06: our Qwen3 / Qwen2 / Llama against transformers (float32, atol 1e-4 on logits)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from nanovllm.book.tiny_models import build_tiny_model
from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.attention import Attention
from nanovllm.layers.context import reset_context, set_decode_context, set_prefill_context
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.rotary_embedding import get_rope, rope_inv_freq, rope_settings
from nanovllm.models.llama import LlamaForCausalLM
from nanovllm.models.loader import build_model
from nanovllm.models.qwen3 import Qwen2ForCausalLM, Qwen3ForCausalLM
from nanovllm.models.registry import get_model_class

ATOL = 1e-4  # float32 logits of standard deviation ~4; observed differences are ~1e-5
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
LINEAR_ROPE = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
VARIANTS = {
    "qwen3": ("qwen3", {}),
    "qwen2": ("qwen2", {}),
    "llama": ("llama", {}),
    "llama-llama3-rope": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    "llama-linear-rope": ("llama", {"rope_parameters": LINEAR_ROPE}),
    "qwen3-attention-bias": ("qwen3", {"attention_bias": True}),
}


@pytest.fixture(autouse=True)
def _clean_context():
    reset_context()
    yield
    reset_context()


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request):
    kind, overrides = VARIANTS[request.param]
    directory = build_tiny_model(kind, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return build_model(directory), hf


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([tokens])).logits[0]


def attach_kv_cache(model: torch.nn.Module, num_blocks: int, block_size: int) -> None:
    for module in model.modules():
        if isinstance(module, Attention):
            shape = (num_blocks, block_size, module.num_kv_heads, module.head_dim)
            module.k_cache = torch.full(shape, float("nan"))  # unwritten slots must never be read
            module.v_cache = torch.full(shape, float("nan"))


def test_rmsnorm_matches_transformers_with_and_without_residual() -> None:
    torch.manual_seed(0)
    ours, theirs = RMSNorm(16, eps=1e-6), Qwen3RMSNorm(16, eps=1e-6)
    weight = torch.randn(16)
    ours.weight.data.copy_(weight)
    theirs.weight.data.copy_(weight)
    for dtype in (torch.float32, torch.bfloat16):
        x, residual = torch.randn(5, 16, dtype=dtype), torch.randn(5, 16, dtype=dtype)
        ours.to(dtype), theirs.to(dtype)
        assert torch.equal(ours(x), theirs(x))
        normed, new_residual = ours(x, residual)
        assert torch.equal(new_residual, x + residual) and torch.equal(normed, theirs(x + residual))


def test_silu_and_mul() -> None:
    x = torch.randn(3, 10)
    torch.testing.assert_close(SiluAndMul()(x), torch.nn.functional.silu(x[:, :5]) * x[:, 5:])


@pytest.mark.parametrize("scaling", [None, {"rope_type": "default"}, LINEAR_ROPE, LLAMA3_ROPE])
def test_rope_frequencies_match_transformers(scaling) -> None:
    ours = rope_inv_freq(16, 10000.0, scaling)
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        expected = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.int64).float() / 16))
    else:
        config = SimpleNamespace(rope_parameters=dict(scaling), head_dim=16, hidden_size=64, num_attention_heads=4,
                                 max_position_embeddings=512, standardize_rope_params=lambda: None)
        expected, _ = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    assert torch.equal(ours, expected)


def test_rope_rotates_pairs_and_rejects_unsupported_scaling() -> None:
    rope = get_rope(8, 8, 32, 10000.0, None)
    q, k = torch.randn(3, 2, 8), torch.randn(3, 1, 8)
    q0, k0 = rope(torch.zeros(3, dtype=torch.long), q, k)
    assert torch.equal(q0, q) and torch.equal(k0, k)  # position 0: no rotation
    q5, _ = rope(torch.full((3,), 5), q, k)
    torch.testing.assert_close(q5.norm(dim=-1), q.norm(dim=-1))  # a rotation keeps lengths
    with pytest.raises(ValueError, match="unsupported rope scaling type 'yarn'"):
        get_rope(8, 8, 32, 10000.0, {"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="needs the key 'low_freq_factor'"):
        get_rope(8, 8, 32, 10000.0, {"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(IndexError):  # Config keeps max_model_len <= max_position_embeddings; torch names the index
        rope(torch.tensor([32]), q[:1], k[:1])
    # both config styles: transformers 5's rope_parameters and the older rope_theta / rope_scaling
    assert rope_settings(SimpleNamespace(rope_parameters={"rope_theta": 5.0, "rope_type": "default"}))[0] == 5.0
    old = SimpleNamespace(rope_theta=7.0, rope_scaling={"type": "linear", "factor": 2.0})
    assert rope_settings(old) == (7.0, {"type": "linear", "factor": 2.0})
    assert torch.equal(rope_inv_freq(8, 7.0, old.rope_scaling), rope_inv_freq(8, 7.0) / 2)


def test_registry() -> None:
    assert get_model_class(["Qwen3ForCausalLM"]) is Qwen3ForCausalLM
    assert get_model_class("Qwen2ForCausalLM") is Qwen2ForCausalLM
    assert get_model_class(["Foo", "LlamaForCausalLM"]) is LlamaForCausalLM
    with pytest.raises(ValueError, match=r"unsupported model architecture \['GPT2LMHeadModel'\]"):
        get_model_class(["GPT2LMHeadModel"])


def test_one_prefill_without_cache_matches_transformers(pair) -> None:
    model, hf = pair
    tokens = list(range(3, 40, 2))
    with torch.inference_mode():
        set_prefill_context([len(tokens)], [len(tokens)])
        hidden = model(torch.tensor(tokens), torch.arange(len(tokens)))
        reset_context()
        logits = model.compute_logits(hidden)
    torch.testing.assert_close(logits, hf_logits(hf, tokens), atol=ATOL, rtol=0)


def test_flat_batch_with_chunks_prefix_sharing_and_decode_matches_transformers(pair) -> None:
    """Step 1: A whole + B's first chunk. Step 2: B's rest (partial block prefix) + C, which shares
    A's first two blocks (a prefix-cache hit). Steps 3-6: decode A, B, C together."""
    model, hf = pair
    bs = 4
    attach_kv_cache(model, num_blocks=40, block_size=bs)
    a = [5, 17, 200, 33, 41, 9, 77, 12, 300, 8, 64]
    b = list(range(100, 121))
    c = [*a[:8], 400, 401, 402]
    tables = {"A": [3, 10, 1, 20], "B": [0, 2, 4, 6, 8, 11, 13], "C": [3, 10, 15, 16]}
    seqs = {"A": a, "B": b, "C": c}

    def step(parts, decode=False):
        ids = torch.tensor([t for name, s, e in parts for t in seqs[name][s:e]])
        pos = torch.cat([torch.arange(s, e) for _, s, e in parts])
        if decode:
            set_decode_context([e for _, _, e in parts], [tables[n] for n, _, _ in parts], bs)
        else:
            set_prefill_context([e - s for _, s, e in parts], [e for _, _, e in parts],
                                [tables[n] for n, _, _ in parts], bs)
        with torch.inference_mode():
            logits = model.compute_logits(model(ids, pos))
        assert logits.shape[0] == len(parts)  # one row per sequence: its last token
        for row, (name, _, e) in zip(logits, parts, strict=True):
            torch.testing.assert_close(row, hf_logits(hf, seqs[name][:e])[-1], atol=ATOL, rtol=0)
        return logits

    first = step([("A", 0, len(a)), ("B", 0, 9)])  # B's row is a partial chunk: discarded
    second = step([("B", 9, len(b)), ("C", 8, len(c))])
    seqs["A"] = [*a, int(first[0].argmax())]
    seqs["B"] = [*b, int(second[0].argmax())]
    seqs["C"] = [*c, int(second[1].argmax())]
    for _ in range(4):
        logits = step([(n, len(seqs[n]) - 1, len(seqs[n])) for n in "ABC"], decode=True)
        for name, row in zip("ABC", logits, strict=True):
            seqs[name] = [*seqs[name], int(row.argmax())]


def test_greedy_tokens_match_transformers_generate(pair) -> None:
    model, hf = pair
    attach_kv_cache(model, num_blocks=8, block_size=16)
    prompt = [11, 22, 33, 44, 55]
    tokens = list(prompt)
    with torch.inference_mode():
        set_prefill_context([len(tokens)], [len(tokens)], [[5, 1]], 16)
        logits = model.compute_logits(model(torch.tensor(tokens), torch.arange(len(tokens))))
        for _ in range(10):
            tokens.append(int(logits[-1].argmax()))
            set_decode_context([len(tokens)], [[5, 1]], 16)
            logits = model.compute_logits(model(torch.tensor(tokens[-1:]), torch.tensor([len(tokens) - 1])))
        reset_context()
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0].tolist()
    assert tokens == expected


def test_tied_llama_shares_one_matrix() -> None:
    model = build_model(build_tiny_model("llama"))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert "lm_head.weight" not in dict(model.named_parameters())
