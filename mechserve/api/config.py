"""The one engine configuration: ``EngineConfig`` and ``SpeculativeConfig`` (standard library only).

``LLM(**kw)``, ``AsyncLLM(**kw)``, ``mechserve generate``/``serve`` and the benchmark all build one
``EngineConfig``; its fields, their defaults and their checks live here and nowhere else::

    LLM("smollm2", max_step_tokens=512, kv_memory="1GiB", speculative_config={"num_speculative_tokens": 4})
        -> EngineConfig.from_args(...)        our names, vLLM's names (max_num_seqs, tensor_parallel_size,
                                              enable_prefix_caching, max_num_batched_tokens, block_size),
                                              sizes as "512MiB", a speculative_config dict
        -> EngineConfig(...)                  every value checked in __post_init__ (ValueError names it)

Sizes are bounded by ``mechserve.api.limits``.  Nothing here imports torch: ``dtype`` is a name
(``"float32"``, ``"bfloat16"``, ``"float16"``), turned into a torch dtype where the model is loaded.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from mechserve.api.limits import (
    ENGINE_LIMITS,
    MAX_KV_MEMORY,
    MAX_SLOTS,
    MAX_SPEC_LEN,
    MAX_SUFFIX_CACHED_REQUESTS,
    MAX_SUFFIX_TREE_DEPTH,
)
from mechserve.api.proposers import ALIASES as METHOD_ALIASES
from mechserve.api.proposers import (
    DEFAULT_METHOD,
    DEFAULT_MODEL_METHOD,
    METHOD_OPTIONS,
    METHODS,
    PROPOSERS,
    proposer_method,
)

# vLLM's chunked-prefill default; a smaller budget splits a long prompt into many slower steps.
DEFAULT_MAX_STEP_TOKENS = 2048
DEFAULT_PAGE_SIZE = 16
# At most this many requests run at once (vLLM's max_num_seqs); on a CPU a step of 64 decodes
# already takes a third of a second, so more would only lengthen every request's steps.
DEFAULT_MAX_RUNNING = 64
# Cap on the KV cache when the pool is sized automatically (no num_pages, no kv_memory): sensible beside a
# quantized model on a 16 GiB laptop (engine/pool.py, AUTO_MAX_POSITIONS).
DEFAULT_KV_BYTES = 1 << 30

# dtype names -> the canonical name ("auto" is float32 on a CPU, the mode checked against transformers).
DTYPES: Mapping[str, str] = {
    "auto": "float32",
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}

# Weight formats the matrices may be kept in (``EngineConfig.quantization``): GGUF's blocks, multiplied
# as they are (``mechserve.model.quantized``, ``mechserve.model.linear``).
QUANTIZATIONS = ("q4_1", "q8_0")

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(?:([kmgt])(i?)b?|(b)?)\s*", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from ``512MiB``, ``2GiB``, ``1.5G``, ``4GB`` (powers of 1000) or a plain number of bytes.

    ``K``/``M``/``G``/``T`` with or without ``i``/``iB`` are powers of 1024;
    ``KB``/``MB``/``GB``/``TB`` are powers of 1000.  Raises ``ValueError``
    for anything else, zero, or more than ``MAX_KV_MEMORY`` (1 PiB).
    """
    match = _SIZE.fullmatch(text)
    if not match:
        raise ValueError(f"expected a size such as 512MiB or 2GiB, got {text!r}")
    number, unit, binary, _ = match.groups()
    unit = (unit or "").lower()
    decimal = bool(unit) and not binary and text.strip().lower().endswith("b")
    scale = 1000 ** "bkmgt".index(unit) if decimal else _UNITS[unit]
    value = float(number) * scale
    if not math.isfinite(value) or value > MAX_KV_MEMORY:
        raise ValueError(f"must be at most {MAX_KV_MEMORY} bytes (1 PiB), got {text!r}")
    if int(value) <= 0:
        raise ValueError(f"must be > 0, got {text!r}")
    return int(value)


def format_bytes(n: int) -> str:
    """``n`` bytes for people: ``12.3 GiB``, ``512.0 MiB``, ``64 B``."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def dtype_name(dtype: object) -> str:
    """The canonical name of ``dtype``: a name of ``DTYPES`` (any case) or a torch dtype of one.

    Raises ``ValueError`` for anything else.
    """
    name = str(dtype).removeprefix("torch.").lower()
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return DTYPES[name]


_DEVICE = re.compile(r"cpu|cuda(?::\d{1,3})?")


def device_name(device: object) -> str:
    """The canonical name of ``device``: ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` (any case, surrounding
    spaces dropped; a ``torch.device`` of one is taken by its name).

    Only the form is checked here (no torch); raises ``ValueError`` naming the value otherwise.
    """
    name = str(device).strip().lower() if isinstance(device, str) or type(device).__name__ == "device" else None
    if name is None or not _DEVICE.fullmatch(name):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    return name


def parse_draft_model(spec: str) -> tuple[str, int | None]:
    """``"MODEL[:layers=N]"`` as ``(MODEL, N or None)``.

    Raises ``ValueError`` saying what is wrong with the spec: not a string, no model before the
    option, an option other than ``layers`` (``smollm2:layer=4``), or an ``N`` that is not a whole
    number >= 1 (``smollm2:layers=x``).  A ``:`` not followed by ``NAME=`` belongs to the model's
    path (``/models/a:b``).
    """
    if not isinstance(spec, str):
        raise ValueError(f"draft model must be MODEL[:layers=N], e.g. smollm2:layers=4, got {spec!r}")
    model, sep, option = spec.strip().rpartition(":")
    key, eq, value = option.partition("=")
    if not sep or not eq or not re.fullmatch(r"[A-Za-z_]\w*", key):
        model, key = spec.strip(), ""
    if not model:
        raise ValueError(f"draft model {spec!r}: name the model before the option, e.g. smollm2:layers=4")
    if not key:
        return model, None
    if key != "layers":
        raise ValueError(
            f"draft model {spec!r}: unknown option {key!r}; the only option is layers=N, e.g. smollm2:layers=4"
        )
    if ":layers=" in model or not value.isdigit() or not value.isascii():
        raise ValueError(f"draft model {spec!r}: layers must be a whole number >= 1, e.g. smollm2:layers=4")
    if int(value) < 1:
        raise ValueError(f"draft model {spec!r}: layers must be >= 1")
    return model, int(value)


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """What speculates and how far (vLLM's ``speculative_config``).

    ``method``: a name of the registry of proposers (``mechserve.api.proposers``): ``"ngram"``
    (prompt lookup: the longest suffix n-gram, ``ngram_min`` <= n <= ``ngram_max``, found earlier in
    the request's own tokens), ``"suffix"`` (suffix decoding: suffix trees over the request's ids and
    over past requests' outputs, ``mechserve.executor.proposers_suffix``, tuned by vLLM's
    ``suffix_decoding_max_tree_depth`` (24: the longest substring the trees hold),
    ``suffix_decoding_max_cached_requests`` (10000 requests' outputs in the global tree, oldest evicted
    first; 0: none), ``suffix_decoding_max_spec_factor`` (1.0: a match of m ids drafts at most
    m ids) and ``suffix_decoding_min_token_prob`` (0.1: a guess less likely than that ends the draft);
    another method refuses them set), ``"eagle"`` (an EAGLE head fed the target's hidden states,
    ``mechserve.model.eagle``: ``eagle_head`` a directory ``mechserve train-draft`` wrote, default the
    one it wrote for the loaded model; ``eagle_draft_vocab`` N > 0: the head chooses among the N ids most
    frequent in its training outputs, FR-Spec, 0: all) or ``"draft"`` (``draft_model``, a ``MODEL[:layers=N]`` spec, e.g.
    ``"smollm2:layers=4"``); a method with a model of its own needs ``draft_model``, one without
    refuses it.  ``num_speculative_tokens`` is the
    engine's ``spec_len``: the most guesses per decode window.  ``adaptive``: before each step the
    control side lowers ``spec_len`` (down to 0) to what the acceptance so far and the proposals at
    hand pay for (``mechserve.executor.governor.Governor``); off, every window carries
    ``num_speculative_tokens`` guesses (a short proposal is padded).  Raises ``ValueError`` for a bad
    value.
    """

    method: str = DEFAULT_METHOD
    num_speculative_tokens: int = 3
    ngram_min: int = 1
    ngram_max: int = 3
    draft_model: str | None = None
    adaptive: bool = True
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    eagle_head: str | None = None
    eagle_draft_vocab: int = 0

    def __post_init__(self) -> None:
        method = proposer_method(self.method)  # ValueError naming the registered methods
        if not _is_int(self.num_speculative_tokens) or not 1 <= self.num_speculative_tokens <= MAX_SPEC_LEN:
            raise ValueError(
                f"num_speculative_tokens must be an integer in [1, {MAX_SPEC_LEN}], got {self.num_speculative_tokens!r}"
            )
        if not _is_int(self.ngram_min) or not 1 <= self.ngram_min <= MAX_SPEC_LEN:
            raise ValueError(f"ngram_min must be an integer in [1, {MAX_SPEC_LEN}], got {self.ngram_min!r}")
        if not _is_int(self.ngram_max) or not self.ngram_min <= self.ngram_max <= MAX_SPEC_LEN:
            raise ValueError(
                f"ngram_max must be an integer in [ngram_min ({self.ngram_min}), {MAX_SPEC_LEN}], got {self.ngram_max!r}"
            )
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"adaptive must be True or False, got {self.adaptive!r}")
        if method.needs_model and not self.draft_model:
            raise ValueError(f'method "{method.name}" needs a draft_model, e.g. "smollm2:layers=4"')
        if not method.needs_model and self.draft_model:
            raise ValueError(
                f'draft_model {self.draft_model!r} is given but method "{method.name}" ({method.summary}) uses no '
                f'model; use method="{DEFAULT_MODEL_METHOD}"'
            )
        if self.draft_model is not None:
            parse_draft_model(self.draft_model)
        self._check_options(method.name)

    def _check_options(self, method: str) -> None:
        """Suffix decoding's options in range, and every method's own options (``ProposerMethod.options``) left at
        their defaults by another method."""
        depth, cached = self.suffix_decoding_max_tree_depth, self.suffix_decoding_max_cached_requests
        factor, prob = self.suffix_decoding_max_spec_factor, self.suffix_decoding_min_token_prob
        if not _is_int(depth) or not 2 <= depth <= MAX_SUFFIX_TREE_DEPTH:
            raise ValueError(
                f"suffix_decoding_max_tree_depth must be an integer in [2, {MAX_SUFFIX_TREE_DEPTH}], got {depth!r}"
            )
        if not _is_int(cached) or not 0 <= cached <= MAX_SUFFIX_CACHED_REQUESTS:
            raise ValueError(
                f"suffix_decoding_max_cached_requests must be an integer in [0, {MAX_SUFFIX_CACHED_REQUESTS}], "
                f"got {cached!r}"
            )
        if not _is_number(factor) or not 0 < factor <= MAX_SPEC_LEN:
            raise ValueError(f"suffix_decoding_max_spec_factor must be a number in (0, {MAX_SPEC_LEN}], got {factor!r}")
        if not _is_number(prob) or not 0 <= prob <= 1:
            raise ValueError(f"suffix_decoding_min_token_prob must be a number in [0, 1], got {prob!r}")
        if self.eagle_head is not None and (not isinstance(self.eagle_head, str) or not self.eagle_head.strip()):
            raise ValueError(f"eagle_head must be the path of a head's directory, got {self.eagle_head!r}")
        if not _is_int(self.eagle_draft_vocab) or self.eagle_draft_vocab < 0:
            raise ValueError(
                f"eagle_draft_vocab must be an integer >= 0 (0: the whole vocabulary), got {self.eagle_draft_vocab!r}"
            )
        for f in dataclasses.fields(self):
            owner = METHOD_OPTIONS.get(f.name, method)
            if owner != method and getattr(self, f.name) != f.default:
                raise ValueError(f'{f.name} is an option of method "{owner}", but method is "{method}"')

    # vLLM's names for our fields.
    ALIASES: ClassVar[Mapping[str, str]] = {
        "prompt_lookup_min": "ngram_min",
        "prompt_lookup_max": "ngram_max",
        "model": "draft_model",
    }

    @classmethod
    def of(cls, config: SpeculativeConfig | Mapping[str, Any] | None) -> SpeculativeConfig | None:
        """A ``SpeculativeConfig`` from itself or a dict of its fields (vLLM's names too; a dict with a draft
        model and no method means the registry's model-based default, ``"draft"``; vLLM's method names are
        read as ours, ``"draft_model"`` as ``"draft"``).

        Raises ``ValueError`` for another type, an unknown field or a bad value.
        """
        if config is None or isinstance(config, SpeculativeConfig):
            return config
        if not isinstance(config, Mapping):
            raise ValueError(f"speculative_config must be a SpeculativeConfig or a dict, got {type(config).__name__}")
        aliases = dict(cls.ALIASES)
        named = config.get("method")
        entry = PROPOSERS.get(METHOD_ALIASES.get(named, named)) if isinstance(named, str) else None
        if entry is not None:  # vLLM's "model" is the method's own model field (an EAGLE head's directory)
            aliases["model"] = entry.model_field
        fields = {aliases.get(k, k): v for k, v in config.items()}
        unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {', '.join(unknown)}")
        if isinstance(fields.get("method"), str):
            fields["method"] = METHOD_ALIASES.get(fields["method"], fields["method"])
        if fields.get("draft_model") and "method" not in fields:
            fields["method"] = DEFAULT_MODEL_METHOD
        return cls(**fields)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything that sizes and shapes one engine; ``LLM`` and ``AsyncLLM`` take exactly these fields.

    * ``dtype``: weights, activations and KV cache: ``"float32"`` (default, the mode checked
      against transformers; ``"auto"`` means it on a CPU), ``"bfloat16"`` or ``"float16"``.
    * ``quantization``: None (the matrices in ``dtype``), ``"q4_1"`` or ``"q8_0"``: every weight
      matrix kept in GGUF's blocks and multiplied as it is, never expanded to a float copy
      (``mechserve.model.quantized``); activations, norms and the KV cache stay in ``dtype``
      (float32 or bfloat16).  ``"q4_1"`` is the embedded SmolLM2's own file (its Q4_1 layers and
      Q8_0 embedding, read from the GGUF); other models are quantized at load with ggml's rounding,
      the embedding and LM head in Q8_0 as in that file.  One rank only.
    * ``max_step_tokens``: the per-step token budget (vLLM's ``max_num_batched_tokens``), which is
      also the prefill chunk; ``page_size``: positions per KV page (``block_size``).
    * The pool: ``num_pages`` pages, else as many as ``kv_memory`` bytes hold (an int or a size such
      as ``"512MiB"``), else automatic: ``AUTO_MAX_POSITIONS`` positions (8,192) or one full context if
      longer, capped at ``max_kv_bytes`` (1 GiB) and half the available memory (``mechserve.engine.pool``).
      ``check_memory`` refuses a cache larger than the available memory.
    * ``max_model_len``: the longest prompt + output a request may have, at most the model's context (None: the model's
      ``max_position_embeddings``).
    * ``prefix_caching``: reuse and publish prompt pages (``enable_prefix_caching``);
      ``hold_shared_prefix``: with prefix caching, admit a request only once the prompt prefix it
      shares with a running request is cached, so that the shared part is computed once (m12's
      option, SGLang's in-batch prefix caching); ``output_caching``: with prefix caching, publish
      every full block of a request's final tokens, generated ones included, so that the next turn
      of a conversation reuses the answer (m13; vLLM caches every full block, SGLang inserts a
      finished request's whole sequence).
    * ``max_running``: the most requests running at once, the rest wait (``max_num_seqs``; default
      ``DEFAULT_MAX_RUNNING``); ``max_waiting``: the most that may wait, beyond which a request is
      refused ``OVERLOADED`` (None: no limit).
    * ``spec_len``: guesses per decode window with prompt lookup, or ``speculative`` (a
      ``SpeculativeConfig``; its ``num_speculative_tokens`` becomes ``spec_len``, which must then
      be 0 or equal to it).
    * ``seed``: seeds the generator that unseeded sampling requests share.
    * ``world_size``: tensor-parallel rank processes (``tensor_parallel_size``;
      ``mechserve.executor.rank_group``).
    * ``device``: where the weights, the KV pool and each step's index tensors live: ``"cpu"``
      (default), ``"cuda"`` or ``"cuda:N"`` (checked for its form here and for being available where
      the model is loaded, ``mechserve.model.loader.torch_device``).  The scheduler always runs on
      the host.  Only ``"cpu"`` with ``world_size > 1``.
    * ``compile``: ``torch.compile`` the dense parts of each decoder layer (norms, projections,
      RoPE, MLP) with dynamic shapes (``LlamaModel.compiled``); attention stays eager.
    * ``allow_additional_properties``: structured outputs follow JSON Schema's open objects (a schema
      without ``additionalProperties`` allows any other property); by default such objects are
      closed, as with vLLM's default grammar backend (``mechserve.executor.structured.close_objects``).

    Raises ``ValueError`` naming the field of a bad value.
    """

    dtype: str = "float32"
    quantization: str | None = None
    max_step_tokens: int = DEFAULT_MAX_STEP_TOKENS
    page_size: int = DEFAULT_PAGE_SIZE
    num_pages: int | None = None
    kv_memory: int | None = None
    max_kv_bytes: int = DEFAULT_KV_BYTES
    check_memory: bool = True
    max_model_len: int | None = None
    prefix_caching: bool = True
    hold_shared_prefix: bool = True
    output_caching: bool = True
    max_running: int | None = DEFAULT_MAX_RUNNING
    max_waiting: int | None = None
    spec_len: int = 0
    speculative: SpeculativeConfig | None = None
    seed: int | None = 0
    world_size: int = 1
    device: str = "cpu"
    compile: bool = False
    allow_additional_properties: bool = False

    # vLLM's names (LLM/EngineArgs keyword arguments) for our fields.
    ALIASES: ClassVar[Mapping[str, str]] = {
        "max_num_seqs": "max_running",
        "max_num_batched_tokens": "max_step_tokens",
        "enable_prefix_caching": "prefix_caching",
        "tensor_parallel_size": "world_size",
        "block_size": "page_size",
        "speculative_config": "speculative",
    }

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        if self.quantization is not None:
            if not isinstance(self.quantization, str) or self.quantization.lower() not in QUANTIZATIONS:
                raise ValueError(
                    f"quantization must be None or one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}"
                )
            object.__setattr__(self, "quantization", self.quantization.lower())
            if self.dtype not in ("float32", "bfloat16"):
                raise ValueError(
                    f"quantization {self.quantization} runs with dtype float32 or bfloat16, not {self.dtype}"
                )
        _size("max_step_tokens", self.max_step_tokens)
        _size("page_size", self.page_size)
        _size("num_pages", self.num_pages, optional=True)
        if self.num_pages is not None and self.num_pages * self.page_size > MAX_SLOTS:
            raise ValueError(
                f"num_pages {self.num_pages} x page_size {self.page_size} = {self.num_pages * self.page_size} slots, "
                f"over mechserve's limit of {MAX_SLOTS} slots; lower one of them"
            )
        if isinstance(self.kv_memory, str):
            try:
                object.__setattr__(self, "kv_memory", parse_size(self.kv_memory))
            except ValueError as exc:
                raise ValueError(f"kv_memory: {exc}") from None
        if self.kv_memory is not None and (not _is_int(self.kv_memory) or not 0 < self.kv_memory <= MAX_KV_MEMORY):
            raise ValueError(
                f"kv_memory must be a number of bytes in [1, {MAX_KV_MEMORY}] or a size such as '512MiB', "
                f"got {self.kv_memory!r}"
            )
        if not _is_int(self.max_kv_bytes) or self.max_kv_bytes <= 0:
            raise ValueError(f"max_kv_bytes must be an integer > 0, got {self.max_kv_bytes!r}")
        _size("max_model_len", self.max_model_len, optional=True)
        _size("max_running", self.max_running, optional=True)
        _size("max_waiting", self.max_waiting, optional=True)
        _size("spec_len", self.spec_len)
        _size("world_size", self.world_size)
        object.__setattr__(self, "device", device_name(self.device))
        if self.device != "cpu" and self.world_size > 1:
            raise ValueError(
                f"device {self.device!r} with world_size > 1 is not supported (rank processes run on the CPU)"
            )
        for name in (
            "check_memory",
            "prefix_caching",
            "hold_shared_prefix",
            "output_caching",
            "compile",
            "allow_additional_properties",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if self.speculative is not None:
            if not isinstance(self.speculative, SpeculativeConfig):
                raise ValueError(f"speculative must be a SpeculativeConfig, got {type(self.speculative).__name__}")
            k = self.speculative.num_speculative_tokens
            if self.spec_len not in (0, k):
                raise ValueError(f"spec_len {self.spec_len} differs from speculative.num_speculative_tokens {k}")
            object.__setattr__(self, "spec_len", k)
        if self.quantization is not None and self.world_size > 1:
            raise ValueError(
                f"quantization {self.quantization} runs on one rank; world_size must be 1, got {self.world_size}"
            )
        if self.quantization is not None and self.device != "cpu":
            raise ValueError(
                f"quantization {self.quantization} runs on the CPU (its kernels are native CPU code); "
                f"device must be 'cpu', got {self.device!r}"
            )

    @classmethod
    def from_args(cls, **kwargs: Any) -> EngineConfig:
        """An ``EngineConfig`` from keyword arguments: our field names or vLLM's (``ALIASES``).

        ``speculative_config`` may be a ``SpeculativeConfig`` or a dict of its fields (vLLM's names
        too); ``kv_memory`` a number of bytes or a size such as ``"512MiB"``.  Raises ``TypeError``
        for an unknown argument (naming the close matches) and ``ValueError`` for one given under
        both names or a bad value.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        fields: dict[str, Any] = {}
        given: dict[str, str] = {}
        for key, value in kwargs.items():
            name = cls.ALIASES.get(key, key)
            if name not in names:
                import difflib

                close = difflib.get_close_matches(key, [*names, *cls.ALIASES], n=3)
                hint = f" (did you mean {', '.join(close)}?)" if close else ""
                raise TypeError(f"unexpected engine argument {key!r}{hint}; see EngineConfig for the list")
            if name in fields:
                raise ValueError(f"{key} and {given[name]} name the same setting; give one of them")
            fields[name], given[name] = value, key
        if "speculative" in fields:
            fields["speculative"] = SpeculativeConfig.of(fields["speculative"])
        return cls(**fields)

    def replace(self, **changes: Any) -> EngineConfig:
        """This config with ``changes`` (our names), checked again."""
        return dataclasses.replace(self, **changes)

    def speculative_config(self) -> SpeculativeConfig | None:
        """``speculative``, or prompt lookup with ``spec_len`` guesses when only ``spec_len`` is set (None: off)."""
        if self.speculative is not None or self.spec_len == 0:
            return self.speculative
        return SpeculativeConfig(method=DEFAULT_METHOD, num_speculative_tokens=self.spec_len)


def _is_number(x: object) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# The least value of an engine size (ENGINE_LIMITS bounds it above); every other size is at least 1.
SETTING_MINIMUM: Mapping[str, int] = {"spec_len": 0}


def setting_range(name: str) -> tuple[int, int]:
    """``(least, most)`` values of the engine size ``name`` (a key of ``ENGINE_LIMITS``)."""
    return SETTING_MINIMUM.get(name, 1), ENGINE_LIMITS[name]


def check_setting(name: str, value: object) -> int:
    """``value`` if it is an integer in ``setting_range(name)``: the one range check of an engine size, used by
    ``EngineConfig``, the CLI's flags (``mechserve.cli.engine_args``) and the spec workloads' engine section.

    Raises ``ValueError`` with a message that names no field (its caller prefixes the field or flag):
    ``must be an integer > 0, got 'x'``, ``must be > 0, got 0`` or ``must be at most 65536 (mechserve's
    limit), got 70000``."""
    least, most = setting_range(name)
    bound = "> 0" if least == 1 else f">= {least}"
    if not _is_int(value):
        raise ValueError(f"must be an integer {bound}, got {value!r}")
    if value < least:  # type: ignore[operator]
        raise ValueError(f"must be {bound}, got {value!r}")
    if value > most:  # type: ignore[operator]
        raise ValueError(f"must be at most {most} (mechserve's limit), got {value!r}")
    return value  # type: ignore[return-value]


def _size(name: str, value: object, *, optional: bool = False) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is in its range (``check_setting``), or None."""
    if value is None and optional:
        return
    try:
        check_setting(name, value)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


__all__ = [
    "DEFAULT_KV_BYTES",
    "DEFAULT_MAX_RUNNING",
    "DEFAULT_MAX_STEP_TOKENS",
    "DEFAULT_PAGE_SIZE",
    "DTYPES",
    "METHODS",
    "QUANTIZATIONS",
    "SETTING_MINIMUM",
    "EngineConfig",
    "SpeculativeConfig",
    "check_setting",
    "device_name",
    "dtype_name",
    "engine_config",
    "format_bytes",
    "parse_draft_model",
    "parse_size",
    "setting_range",
]


def engine_config(config: EngineConfig | None, engine_args: Mapping[str, Any]) -> EngineConfig:
    """``config``, or the ``EngineConfig`` the keyword arguments name (``EngineConfig.from_args``); both
    together are an error.  What ``LLM`` and ``AsyncLLM`` share."""
    if config is not None:
        if engine_args:
            raise TypeError(f"give config= or engine keywords, not both (got {', '.join(sorted(engine_args))})")
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        return config
    return EngineConfig.from_args(**engine_args)
