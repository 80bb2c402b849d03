"""The model seam: the ``Model`` protocol, the registry of families, the one weight-name map every loader reads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_checkpoints import Tiny, build_tiny, random_prompts, save_tiny, tiny_config

from mechserve.api.errors import ModelLoadError
from mechserve.api.params import SamplingParams
from mechserve.kv.paged import Span, build_attention_batch
from mechserve.model import registry
from mechserve.model.arch import LlamaVariant
from mechserve.model.formats import SafetensorsFiles
from mechserve.model.loader import load_model, load_shard
from mechserve.model.protocol import Model
from mechserve.model.registry import FAMILIES, ModelFamily, find_family
from mechserve.model.weights import LAYER_PARTS, MODEL_PARTS, assemble, gguf_to_hf

TOL = 1e-4


def prefill_logits(model: Any, ids: list[int]) -> torch.Tensor:
    """Our logits for every row of one prompt, on one page that holds it."""
    n = len(ids)
    a = model.arch
    batch = build_attention_batch(
        [Span(0, 0, n, [0])], list(range(n)), n, a.num_heads // a.num_kv_heads, model.distinct_sliding_windows
    )
    return model.forward(torch.tensor(ids), torch.arange(n), model.new_cache(1, n), batch)


def hf_logits(hf: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def set_config(path: Path, **fields: Any) -> None:
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **fields}))


# The registry ---------------------------------------------------------------------------------------------------


def test_the_registry_holds_every_family_that_loads_today() -> None:
    assert {f.model_type for f in FAMILIES.values()} == {"llama", "mistral", "qwen2", "qwen3"}
    assert set(FAMILIES) == {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}


def test_the_architecture_decides_and_model_type_is_the_fallback() -> None:
    assert find_family(["Qwen2ForCausalLM"], "qwen2", "x").architecture == "Qwen2ForCausalLM"
    assert find_family(None, "qwen3", "x").architecture == "Qwen3ForCausalLM"  # a config saved without a model class
    assert find_family([], "mistral", "x").architecture == "MistralForCausalLM"
    assert find_family(["Foo", "LlamaForCausalLM"], "llama", "x").architecture == "LlamaForCausalLM"


def test_a_head_the_registry_does_not_know_is_refused_even_for_a_known_model_type(tmp_path: Path) -> None:
    """Before the registry a classifier checkpoint of model_type llama loaded as a causal LM (its head tied to
    the embedding); now its architecture is named and the known ones listed."""
    save_tiny(tmp_path, tiny_config())
    set_config(tmp_path, architectures=["LlamaForSequenceClassification"])
    with pytest.raises(ModelLoadError) as err:
        load_model(str(tmp_path), tokenizer=False)
    message = str(err.value)
    assert "unsupported architecture LlamaForSequenceClassification (model_type 'llama')" in message
    assert registry.supported() in message and "\n" not in message


def test_a_llama_shaped_family_is_one_registry_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint of an architecture the registry does not know loads once one ``ModelFamily`` line names it,
    and computes what transformers computes."""
    hf = save_tiny(tmp_path, tiny_config("qwen2"))
    set_config(tmp_path, architectures=["NewQwenForCausalLM"])
    with pytest.raises(ModelLoadError, match="unsupported architecture NewQwenForCausalLM"):
        load_model(str(tmp_path), tokenizer=False)
    entry = ModelFamily("NewQwenForCausalLM", "qwen2", LlamaVariant(qkv_bias=True, o_bias=False, mlp_bias=False))
    monkeypatch.setitem(FAMILIES, entry.architecture, entry)
    model = load_model(str(tmp_path), tokenizer=False).model
    (ids,) = random_prompts([13])
    torch.testing.assert_close(prefill_logits(model, ids), hf_logits(hf, ids), atol=TOL, rtol=0)


# Which parts a family has: its variant, not whichever tensors a file holds ---------------------------------------


def test_a_tensor_the_family_does_not_have_is_not_read_as_transformers_ignores_it(tmp_path: Path) -> None:
    """Biases in a Llama checkpoint whose config says ``attention_bias: false``: transformers ignores them, so we do
    (before, any bias tensor present was added)."""
    hf = save_tiny(tmp_path, tiny_config())
    weights = load_file(tmp_path / "model.safetensors")
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        rows = weights[f"model.layers.0.self_attn.{name}.weight"].shape[0]
        weights[f"model.layers.0.self_attn.{name}.bias"] = torch.full((rows,), 5.0)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model = load_model(str(tmp_path), tokenizer=False).model
    assert model.layers[0].qkv_bias is None and model.layers[0].o_bias is None  # type: ignore[attr-defined]
    (ids,) = random_prompts([9])
    torch.testing.assert_close(prefill_logits(model, ids), hf_logits(hf, ids), atol=TOL, rtol=0)


@pytest.mark.parametrize(
    ("model_type", "overrides", "dropped"),
    [
        ("qwen3", dict(head_dim=16), "model.layers.1.self_attn.k_norm.weight"),
        ("qwen2", dict(), "model.layers.0.self_attn.v_proj.bias"),
        ("llama", dict(mlp_bias=True), "model.layers.1.mlp.down_proj.bias"),
    ],
)
def test_a_part_the_family_has_is_required(
    tmp_path: Path, model_type: str, overrides: dict[str, Any], dropped: str
) -> None:
    save_tiny(tmp_path, tiny_config(model_type, **overrides))
    weights = load_file(tmp_path / "model.safetensors")
    del weights[dropped]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=f"missing tensor '{dropped}'"):
        load_model(str(tmp_path), tokenizer=False)


# The weight-name map ----------------------------------------------------------------------------------------------


def test_the_map_names_every_tensor_as_gguf_py_does() -> None:
    """Our GGUF column is llama.cpp's (gguf-py's ``TensorNameMap``), and ``gguf_to_hf`` inverts it."""
    import gguf

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, 4)  # Llama's tensors plus the q/k norms
    for part in (*MODEL_PARTS, *LAYER_PARTS):
        for piece in part.pieces:
            hf, ours = piece.hf.format(i=3), piece.gguf.format(i=3)
            assert names.get_name(hf, try_suffixes=(".weight", ".bias")) == ours, hf
            found = gguf_to_hf(ours)
            assert found is not None and found[0] == hf and found[1] is part
    assert gguf_to_hf("blk.3.attn_rot_embd") is None


def test_the_matrices_are_the_four_projections_and_the_embeddings() -> None:
    """What a quantized model keeps in blocks: the map's ``matrix``/``embedding`` roles (norms and biases stay floats)."""
    roles = {part.name: part.role for part in (*MODEL_PARTS, *LAYER_PARTS)}
    assert {n for n, r in roles.items() if r == "matrix"} == {"qkv", "o", "gate_up", "down"}
    assert {n for n, r in roles.items() if r == "embedding"} == {"embed", "lm_head"}


def test_a_ranks_parts_are_its_megatron_slices_of_the_whole(tmp_path: Path) -> None:
    """The map's one split rule (a span of every q, kv, inter and vocab axis) gives the column- and row-parallel
    slices of every part, biases and q/k norms included."""
    t = build_tiny(tmp_path, "qwen3", head_dim=16, attention_bias=True)
    a = t.model.arch
    d = a.head_dim
    inter, vocab = (32, 80), (50, 128)
    split = {"q": (2 * d, 4 * d), "kv": (1 * d, 2 * d), "inter": inter, "vocab": vocab}  # Q heads 2-3 read KV head 1
    with SafetensorsFiles(tmp_path, torch.float32) as files:
        whole = assemble(files, a)  # type: ignore[arg-type]
        rank = assemble(files, a, split)  # type: ignore[arg-type]
    qs, kvs = slice(*split["q"]), slice(*split["kv"])
    hq, hkv = a.num_heads * d, a.num_kv_heads * d
    for w, r in zip(whole.layers, rank.layers):
        rows = torch.cat([w.qkv[:hq][qs], w.qkv[hq : hq + hkv][kvs], w.qkv[hq + hkv :][kvs]])
        assert torch.equal(r.qkv, rows)
        bias = torch.cat([w.qkv_bias[:hq][qs], w.qkv_bias[hq : hq + hkv][kvs], w.qkv_bias[hq + hkv :][kvs]])
        assert torch.equal(r.qkv_bias, bias)
        assert torch.equal(r.o, w.o[:, qs]) and torch.equal(r.o_bias, w.o_bias)  # row-parallel: columns, bias whole
        i = a.intermediate_size
        assert torch.equal(r.gate_up, torch.cat([w.gate_up[:i][slice(*inter)], w.gate_up[i:][slice(*inter)]]))
        assert torch.equal(r.down, w.down[:, slice(*inter)])
        assert torch.equal(r.q_norm, w.q_norm) and torch.equal(r.post_norm, w.post_norm)  # replicated
    assert torch.equal(rank.embed, whole.embed[slice(*vocab)]) and torch.equal(
        rank.lm_head, whole.lm_head[slice(*vocab)]
    )
    assert torch.equal(rank.norm, whole.norm)


def test_a_rank_without_the_drivers_shape_reads_it_from_the_config(tiny: Tiny) -> None:
    m = tiny.model
    given = load_shard(tiny.path, 1, 2, arch=m.arch, rope=(m.inv_freq, m.rope_scaling))
    read = load_shard(tiny.path, 1, 2)
    assert read.full_arch == given.full_arch == m.arch and read.arch == given.arch
    assert torch.equal(read.inv_freq, given.inv_freq) and read.rope_scaling == given.rope_scaling
    assert all(torch.equal(a.qkv, b.qkv) and torch.equal(a.down, b.down) for a, b in zip(read.layers, given.layers))


# The Model protocol ----------------------------------------------------------------------------------------------


class Delegate:
    """A model that is not a ``LlamaModel``: exactly the ``Model`` protocol's members, passed to one.  If the
    executor, the proposers or the engine read anything else of a model, running it fails."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    arch = property(lambda self: self._inner.arch)
    dtype = property(lambda self: self._inner.dtype)
    quantization = property(lambda self: self._inner.quantization)
    device = property(lambda self: self._inner.device)
    distinct_sliding_windows = property(lambda self: self._inner.distinct_sliding_windows)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self._inner.forward(*args, **kwargs)

    def new_cache(self, *args: Any, **kwargs: Any) -> Any:
        return self._inner.new_cache(*args, **kwargs)

    def to(self, device: Any) -> Delegate:
        return Delegate(self._inner.to(device))

    def compiled(self) -> Delegate:
        return Delegate(self._inner.compiled())

    def truncated(self, num_layers: int) -> Delegate:
        return Delegate(self._inner.truncated(num_layers))

    def weight_elements(self) -> tuple[int, int]:
        return self._inner.weight_elements()  # type: ignore[no-any-return]


def generate(model: Any, draft: Any, prompts: list[list[int]]) -> tuple[list[list[int]], int]:
    """Greedy ids of ``prompts`` with ``draft`` proposing, and how many guesses it made."""
    from mechserve.api.config import EngineConfig, SpeculativeConfig
    from mechserve.engine.core import EngineCore
    from mechserve.executor.torch_executor import TorchExecutor
    from mechserve.model.loader import LoadedModel

    spec = SpeculativeConfig(method="draft", num_speculative_tokens=3, draft_model="smollm2:layers=1", adaptive=False)
    config = EngineConfig(num_pages=48, page_size=4, speculative=spec)  # the executor below holds the draft
    executor = TorchExecutor(model, 48, 4, speculative=spec, draft_model=draft)
    core = EngineCore(LoadedModel(Path("."), model, None, ()), config, executor=executor)
    for p in prompts:
        core.add_request(p, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    done = sorted(core.run_until_idle(), key=lambda d: int(d.request_id))
    return [list(d.outputs[0].token_ids) for d in done], executor.stats().proposed


def test_the_engine_runs_any_model_through_the_protocol_alone(tiny: Tiny) -> None:
    assert isinstance(tiny.model, Model) and isinstance(Delegate(tiny.model), Model)
    assert not isinstance(load_model(str(tiny.path), tokenizer=False, weights=False).model, Model)  # a shape only
    prompts = random_prompts([11, 5, 17], seed=4)
    plain, proposed = generate(tiny.model, tiny.model.truncated(1), prompts)
    assert proposed > 0  # the draft model really proposed
    assert generate(Delegate(tiny.model), Delegate(tiny.model).truncated(1), prompts) == (plain, proposed)
