"""Loading HF directories: packed and tied weights, and clear errors for broken checkpoints; tiny models."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from nanovllm.book.tiny_models import build_tiny_model
from nanovllm.models.loader import ModelLoadError, build_model, read_model_dir


@pytest.fixture
def copy_of(tmp_path: Path, tiny: Path):
    def make(source: Path = tiny) -> Path:
        return Path(shutil.copytree(source, tmp_path / "model"))

    return make


def test_packed_weights_land_in_their_rows(tiny: Path) -> None:
    model, weights = build_model(tiny), load_file(tiny / "model.safetensors")
    for i in range(2):
        prefix = f"model.layers.{i}"
        qkv = model.get_parameter(f"{prefix}.self_attn.qkv_proj.weight")
        expected = torch.cat([weights[f"{prefix}.self_attn.{n}_proj.weight"] for n in "qkv"])
        assert torch.equal(qkv, expected)
        gate_up = model.get_parameter(f"{prefix}.mlp.gate_up_proj.weight")
        assert torch.equal(gate_up, torch.cat([weights[f"{prefix}.mlp.{n}_proj.weight"] for n in ("gate", "up")]))
        assert torch.equal(model.get_parameter(f"{prefix}.self_attn.q_norm.weight"),
                           weights[f"{prefix}.self_attn.q_norm.weight"])
    assert torch.equal(model.lm_head.weight, weights["lm_head.weight"])
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_tied_embeddings(copy_of) -> None:
    llama_dir = build_tiny_model("llama")
    weights = load_file(llama_dir / "model.safetensors")
    assert "lm_head.weight" not in weights
    model = build_model(llama_dir)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, weights["model.embed_tokens.weight"])
    # a tied checkpoint that also stores lm_head.weight: the embedding is the head, as in transformers
    directory = copy_of(llama_dir)
    save_file({**weights, "lm_head.weight": torch.zeros_like(weights["model.embed_tokens.weight"])},
              str(directory / "model.safetensors"))
    assert torch.equal(build_model(directory).lm_head.weight, weights["model.embed_tokens.weight"])


def test_sharded_checkpoint_over_several_files(copy_of) -> None:
    directory = copy_of()
    weights = load_file(directory / "model.safetensors")
    names = sorted(weights)
    (directory / "model.safetensors").unlink()
    save_file({n: weights[n] for n in names[::2]}, str(directory / "model-00001-of-00002.safetensors"))
    save_file({n: weights[n] for n in names[1::2]}, str(directory / "model-00002-of-00002.safetensors"))
    assert torch.equal(build_model(directory).lm_head.weight, weights["lm_head.weight"])
    save_file({names[0]: weights[names[0]]}, str(directory / "model-extra.safetensors"))
    with pytest.raises(ModelLoadError, match=f"tensor '{names[0]}' appears twice"):
        build_model(directory)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda w: w.pop("model.layers.1.self_attn.v_proj.weight"),
         r"missing 1 tensor\(s\): model.layers.1.self_attn.v_proj.weight"),
        (lambda w: w.pop("lm_head.weight"), r"missing 1 tensor\(s\): lm_head.weight"),
        (lambda w: w.pop("model.layers.0.mlp.up_proj.weight"), r"model.layers.0.mlp.up_proj.weight"),
        (lambda w: w.update({"model.layers.0.self_attn.extra.weight": torch.zeros(1)}),
         r"unexpected tensor 'model.layers.0.self_attn.extra.weight'"),
        (lambda w: w.update({"model.layers.9.input_layernorm.weight": torch.zeros(64)}),
         r"unexpected tensor 'model.layers.9.input_layernorm.weight'"),
        (lambda w: w.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(16, 64)}),
         r"tensor 'model.layers.0.self_attn.k_proj.weight' in model.safetensors: k projection should have 32 rows"),
        (lambda w: w.update({"model.norm.weight": torch.zeros(65)}),
         r"tensor 'model.norm.weight' in model.safetensors: .*\(65,\) does not fit"),
    ],
)
def test_bad_tensors_are_named(copy_of, change, message: str) -> None:
    directory = copy_of()
    weights = load_file(directory / "model.safetensors")
    change(weights)
    save_file(weights, str(directory / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=message):
        build_model(directory)


def test_ignored_rotary_buffers(tiny: Path, copy_of) -> None:
    """Some checkpoints carry rotary_emb.inv_freq: it is derived from the config, so the loader skips it."""
    directory = copy_of()
    weights = load_file(directory / "model.safetensors")
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(8)
    save_file(weights, str(directory / "model.safetensors"))
    loaded, reference = build_model(directory), build_model(tiny)
    for tensors in (lambda m: m.named_parameters(), lambda m: m.named_buffers()):
        got, expected = dict(tensors(loaded)), dict(tensors(reference))
        assert got.keys() == expected.keys() and len(got) > 0
        assert all(torch.equal(got[name], expected[name]) for name in got), "the skipped tensor changed the model"


def test_broken_directories(tmp_path: Path, copy_of) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        build_model(tmp_path / "nowhere")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ModelLoadError, match="is not a directory"):
        build_model(tmp_path / "file")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match=r"has no config\.json"):
        build_model(tmp_path / "empty")
    directory = copy_of()
    config_text = (directory / "config.json").read_text()
    (directory / "config.json").write_text(config_text[:40])
    with pytest.raises(ModelLoadError, match="is not valid JSON"):
        build_model(directory)
    config = json.loads(config_text)
    (directory / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "architectures"}))
    with pytest.raises(ModelLoadError, match="no 'architectures' list"):
        build_model(directory)
    (directory / "config.json").write_text(json.dumps({**config, "architectures": ["BertForMaskedLM"]}))
    with pytest.raises(ValueError, match=r"unsupported model architecture \['BertForMaskedLM'\]; supported: Qwen3"):
        read_model_dir(directory)
    (directory / "config.json").write_text(config_text)
    (directory / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelLoadError, match="is not a readable safetensors file"):
        build_model(directory)
    (directory / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"has no \*.safetensors files"):
        build_model(directory)


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"hidden_size": -64}, ValueError, "hidden_size must be >= 1, got -64"),
        ({"num_attention_heads": 0}, ValueError, "num_attention_heads must be >= 1, got 0"),
        # Refused from the raw JSON, before transformers reads it: the message names the field and the file.
        ({"num_hidden_layers": 2.5}, TypeError, "num_hidden_layers must be an int, got float 2.5"),
        ({"num_key_value_heads": 3}, ValueError, r"num_attention_heads \(4\) must be a multiple of num_key_value"),
        ({"head_dim": 0}, ValueError, "head_dim must be >= 1"),
        ({"rms_norm_eps": -1e-6}, ValueError, "rms_norm_eps must be > 0"),
        ({"hidden_act": "gelu"}, ValueError, "unsupported hidden_act 'gelu'"),
    ],
    ids=["negative-size", "no-heads", "float-layers", "kv-heads", "head-dim", "eps", "activation"],
)
def test_nonsense_model_configs_are_refused_by_field_and_file(copy_of, change: dict, error: type,
                                                              message: str) -> None:
    directory = copy_of()
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(error, match=message) as caught:
        read_model_dir(directory)
    assert str(directory / "config.json") in str(caught.value)


def test_config_json_is_read_once_per_engine(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Config reads it; the model runner builds the model from that result, not from the file again."""
    from transformers import AutoConfig

    from nanovllm import LLM, SamplingParams

    original, ours = AutoConfig.from_pretrained.__func__, []

    def counting(cls, *args, **kwargs):
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller.startswith("nanovllm"):
            ours.append(caller)
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(AutoConfig, "from_pretrained", classmethod(counting))
    llm = LLM(str(tiny), num_kvcache_blocks=8, kvcache_block_size=16, max_model_len=64, max_num_seqs=2)
    try:
        assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)[0]["token_ids"]
    finally:
        llm.exit()
    assert ours == ["nanovllm.models.loader"]


def test_unsupported_features_are_refused(tmp_path: Path) -> None:
    directory = build_tiny_model("qwen2", tmp_path / "sliding", use_sliding_window=True, sliding_window=8)
    with pytest.raises(ValueError, match="sliding-window attention"):
        build_model(directory)


@pytest.mark.parametrize("kind", ["qwen3", "qwen2", "llama"])
def test_tiny_models_load_in_transformers(kind: str) -> None:
    directory = build_tiny_model(kind)
    config = json.loads((directory / "config.json").read_text())
    assert config["hidden_size"] == 64 and config["num_hidden_layers"] == 2 and config["num_key_value_heads"] == 2
    tokenizer = AutoTokenizer.from_pretrained(directory)
    text = "The capital of France is Paris."
    ids = tokenizer(text).input_ids
    assert tokenizer.decode(ids) == text and max(ids) < config["vocab_size"]
    assert len(ids) < len(text) / 2  # the BPE learned merges
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    eos = GenerationConfig.from_pretrained(directory).eos_token_id
    assert eos == [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    assert model.config.architectures == config["architectures"]


def test_tiny_models_are_deterministic_and_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NANOVLLM_CACHE", str(tmp_path / "cache"))
    first = build_tiny_model("qwen3")
    assert first.parent == tmp_path / "cache" and first.name.startswith("tiny-qwen3-")
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_model("qwen3") == first and (first / "model.safetensors").stat().st_mtime_ns == stamp
    explicit = build_tiny_model("qwen3", tmp_path / "explicit")
    assert explicit == tmp_path / "explicit"
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (explicit / name).read_bytes() == (first / name).read_bytes()
    other_seed = build_tiny_model("qwen3", seed=1)
    assert other_seed != first
    assert (other_seed / "model.safetensors").read_bytes() != (first / "model.safetensors").read_bytes()
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted([first.name, other_seed.name])
    with pytest.raises(ValueError, match="unknown tiny model kind 'gpt2'"):
        build_tiny_model("gpt2")
