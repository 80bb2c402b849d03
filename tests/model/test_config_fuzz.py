"""A ``config.json`` of any shape is one clear ``ModelLoadError`` or a model that runs, never another exception.

The trial found ``internal error: AttributeError`` for a config that is a JSON list; the kind is
"every malformed model directory is one clear line", so the property fuzzes the file's shape: not
an object, a field dropped, a field set to any JSON value.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_checkpoints import save_tiny, tiny_config

from mechserve.api.config import EngineConfig
from mechserve.api.errors import ModelLoadError, RequestRejected
from mechserve.api.params import SamplingParams
from mechserve.engine.core import EngineCore
from mechserve.model.loader import load_model

ROOT = Path(__file__).resolve().parents[2]
# The fields the forward reads, and a few it does not: every one may be broken.
FIELDS = (
    "model_type",
    "architectures",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "num_hidden_layers",
    "head_dim",
    "vocab_size",
    "rms_norm_eps",
    "rope_theta",
    "rope_parameters",
    "rope_scaling",
    "max_position_embeddings",
    "hidden_act",
    "tie_word_embeddings",
    "sliding_window",
    "layer_types",
    "eos_token_id",
    "bos_token_id",
    "torch_dtype",
    "attention_bias",
)
JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-3, 3)
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8)
    | st.sampled_from(["llama", "silu", "default", "sliding_attention", "float32"]),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(["rope_type", "rope_theta", "factor", "type"]), inner, max_size=3)
    ),
    max_leaves=6,
)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    path = tmp_path_factory.mktemp("fuzz-config")
    save_tiny(path, tiny_config())
    return path, json.loads((path / "config.json").read_text())


def broken(config: dict[str, Any]) -> st.SearchStrategy[Any]:
    """A document that is not an object, the config with one field dropped, or with one field set to any value."""
    not_object = JSON.filter(lambda v: not isinstance(v, dict))
    dropped = st.sampled_from(sorted(config)).map(lambda k: {f: v for f, v in config.items() if f != k})
    changed = st.tuples(st.sampled_from(FIELDS), JSON).map(lambda kv: {**config, kv[0]: kv[1]})
    return not_object | dropped | changed


def loads_or_says_why(path: Path) -> str:
    """ "ModelLoadError" or "ran" (one greedy token, or a refusal the door names); anything else raises."""
    try:
        loaded = load_model(str(path), tokenizer=False)
    except ModelLoadError as exc:
        assert "\n" not in str(exc), str(exc)
        return "ModelLoadError"
    core = EngineCore(loaded, EngineConfig(num_pages=16, page_size=4))
    try:
        core.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=1))
    except RequestRejected:
        return "ran"
    core.run_until_idle()
    return "ran"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_config_shape_is_a_model_or_a_model_load_error(tiny_dir, data) -> None:
    path, config = tiny_dir
    document = data.draw(broken(config))
    (path / "config.json").write_text(json.dumps(document))
    try:
        loads_or_says_why(path)
    finally:
        (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ([1, 2], r"must hold a JSON object \(a model's settings\), not a list"),
        ("llama", "not a string"),
        ({"hidden_size": 64}, r"unsupported model_type None \(config.json names no architecture\)"),
        ({"model_type": "gpt2", "architectures": 5}, "architectures must be a list of class names, got 5"),
        (
            {"model_type": "gpt2", "architectures": ["LlamaForCausalLM"]},
            "unsupported model_type 'gpt2' for architecture LlamaForCausalLM",
        ),
    ],
)
def test_the_trials_configs_are_one_clear_line(tiny_dir, document: Any, message: str) -> None:
    path, config = tiny_dir
    (path / "config.json").write_text(json.dumps(document))
    try:
        with pytest.raises(ModelLoadError, match=message):
            load_model(str(path), tokenizer=False)
    finally:
        (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("hidden_size", "x", "hidden_size"),
        ("num_hidden_layers", None, "num_hidden_layers"),
        ("num_attention_heads", 0, "num_attention_heads must be a whole number >= 1, got 0"),
        ("vocab_size", -1, "vocab_size must be a whole number >= 1, got -1"),
        ("rms_norm_eps", -1.0, "rms_norm_eps must be a number > 0"),
        ("vocab_size", 64, r"model\.embed_tokens\.weight has shape \[128, 64\], but config.json implies \[64, 64\]"),
        (
            "intermediate_size",
            100,
            r"model\.layers\.0\.mlp\.gate_proj\.weight has shape \[128, 64\], but config.json implies \[100, 64\]",
        ),
        ("attention_bias", True, r"missing tensor 'model\.layers\.0\.self_attn\.q_proj\.bias'"),
        ("attention_bias", "yes", "attention_bias"),
    ],
)
def test_a_field_of_the_wrong_type_or_value_is_named(tiny_dir, field: str, value: Any, message: str) -> None:
    path, config = tiny_dir
    (path / "config.json").write_text(json.dumps({**config, field: value}))
    try:
        with pytest.raises(ModelLoadError, match=message):
            load_model(str(path), tokenizer=False)
    finally:
        (path / "config.json").write_text(json.dumps(config))


def test_a_config_that_is_a_list_is_one_line_and_status_2_from_the_cli(tmp_path: Path) -> None:
    save_tiny(tmp_path, tiny_config())
    (tmp_path / "config.json").write_text("[]")
    done = subprocess.run(
        [sys.executable, "-m", "mechserve", "generate", "w1", "--model", str(tmp_path), "--max-tokens", "1"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("mechserve: error: ") and "must hold a JSON object" in done.stderr
