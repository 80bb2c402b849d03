"""``EngineConfig``: one config for every entry point, with our names and vLLM's, and a clear error for anything else."""

from __future__ import annotations

import inspect

import pytest

from mechserve.api.config import DEFAULT_MAX_RUNNING, EngineConfig, SpeculativeConfig, parse_size


def test_vllm_names_are_our_fields() -> None:
    c = EngineConfig.from_args(
        max_num_seqs=8, max_num_batched_tokens=512, enable_prefix_caching=False, tensor_parallel_size=2, block_size=8
    )
    assert (c.max_running, c.max_step_tokens, c.prefix_caching, c.world_size, c.page_size) == (8, 512, False, 2, 8)


def test_an_unknown_argument_is_a_type_error_naming_close_ones() -> None:
    with pytest.raises(TypeError, match=r"unexpected engine argument 'max_num_seq' \(did you mean max_num_seqs"):
        EngineConfig.from_args(max_num_seq=4)
    with pytest.raises(TypeError, match="'gpu_memory_utilization'"):
        EngineConfig.from_args(gpu_memory_utilization=0.9)


def test_one_setting_under_two_names_is_refused() -> None:
    with pytest.raises(ValueError, match="max_num_seqs and max_running name the same setting"):
        EngineConfig.from_args(max_running=4, max_num_seqs=8)


def test_kv_memory_takes_the_cli_sizes() -> None:
    assert EngineConfig.from_args(kv_memory="512MiB").kv_memory == 512 << 20
    assert EngineConfig(kv_memory="1.5G").kv_memory == parse_size("1.5G")
    with pytest.raises(ValueError, match="kv_memory: expected a size such as 512MiB"):
        EngineConfig(kv_memory="lots")
    with pytest.raises(ValueError, match="kv_memory must be"):
        EngineConfig(kv_memory=0)


def test_speculative_config_as_a_dict_with_vllm_names() -> None:
    c = EngineConfig.from_args(speculative_config={"model": "smollm2:layers=2", "num_speculative_tokens": 2})
    assert c.speculative == SpeculativeConfig(method="draft", num_speculative_tokens=2, draft_model="smollm2:layers=2")
    assert c.spec_len == 2
    with pytest.raises(ValueError, match="unknown field"):
        EngineConfig.from_args(speculative_config={"draft_tensor_parallel_size": 1})
    with pytest.raises(ValueError, match="layers must be a whole number"):
        SpeculativeConfig(method="draft", draft_model="smollm2:layers=x")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("max_step_tokens", 0, "max_step_tokens: must be > 0, got 0"),
        ("page_size", 10**9, r"page_size: must be at most 65536 \(mechserve's limit\)"),
        ("num_pages", True, "num_pages: must be an integer > 0, got True"),
        ("spec_len", 65, "spec_len: must be at most 64"),
        ("world_size", 0, "world_size: must be"),
        ("max_running", -1, "max_running: must be"),
        ("dtype", "int8", "dtype must be one of"),
        ("prefix_caching", "yes", "prefix_caching must be True or False"),
        ("seed", 1.5, "seed must be an integer or None"),
    ],
)
def test_a_bad_value_names_its_field(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**{field: value})  # type: ignore[arg-type]


def test_too_many_slots_is_refused() -> None:
    with pytest.raises(ValueError, match="slots, over mechserve's limit"):
        EngineConfig(num_pages=1_000_000, page_size=64)


def test_dtype_names_are_canonical() -> None:
    assert EngineConfig(dtype="bf16").dtype == "bfloat16" and EngineConfig(dtype="auto").dtype == "float32"


def test_llm_and_async_llm_take_the_same_settings() -> None:
    """Both pass their keywords to ``EngineConfig.from_args``: no entry point restates a setting or its default."""
    from mechserve.entrypoints.async_llm import AsyncLLM
    from mechserve.entrypoints.llm import LLM

    for cls in (LLM, AsyncLLM):
        params = inspect.signature(cls.__init__).parameters
        assert params["engine_args"].kind is inspect.Parameter.VAR_KEYWORD
        assert params["config"].default is None
        assert not set(params) & {f for f in EngineConfig.__dataclass_fields__}, cls
    assert EngineConfig().max_running == DEFAULT_MAX_RUNNING and EngineConfig().max_waiting is None


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("smollm2:layers=x", "layers must be a whole number >= 1"),
        ("smollm2:layers=", "layers must be a whole number >= 1"),
        ("smollm2:layers=-1", "layers must be a whole number >= 1"),
        ("smollm2:layers=٣", "layers must be a whole number >= 1"),  # a digit, but not an ASCII one
        ("smollm2:layers=4:layers=2", "layers must be a whole number >= 1"),
        ("smollm2:layers=0", "layers must be >= 1"),
        ("smollm2:layer=4", "unknown option 'layer'; the only option is layers=N"),
        (":layers=2", "name the model before the option"),
        ("", "name the model before the option"),
    ],
)
def test_a_bad_draft_model_spec_says_what_is_wrong_with_it(spec: str, message: str) -> None:
    """The trial: ``--draft-model smollm2:layers=x`` said "model directory not found"."""
    from mechserve.api.config import parse_draft_model

    with pytest.raises(ValueError, match=message):
        parse_draft_model(spec)


def test_a_draft_model_spec_keeps_a_colon_of_the_path() -> None:
    from mechserve.api.config import parse_draft_model

    assert parse_draft_model("smollm2:layers=4") == ("smollm2", 4)
    assert parse_draft_model("/models/a:b") == ("/models/a:b", None)
    assert parse_draft_model("/models/a:b:layers=2") == ("/models/a:b", 2)
