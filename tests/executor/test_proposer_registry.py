"""The registry of proposers (``mechserve.api.proposers``, issue 25 item 4): one place that names the
speculative methods, read by the config, the CLI, the engine and the executor (in every rank process).

A model-free proposer is its class plus one registry entry; the test here adds one (``echo``: guesses the
last id again) by an entry alone, and the engine, the config and the executor take it with no other change.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
from tiny_engines import random_prompts

from mechserve.api import proposers as registry
from mechserve.api.config import EngineConfig, SpeculativeConfig
from mechserve.api.params import SamplingParams
from mechserve.api.proposers import PROPOSERS, ProposerContext, ProposerMethod, proposer_method
from mechserve.engine.core import EngineCore
from mechserve.executor.proposers import NO_DRAFT, Draft, Window
from mechserve.executor.request import ExecutorRequest

ROOT = Path(__file__).resolve().parents[2] / "mechserve"


def test_every_entry_resolves() -> None:
    for method in PROPOSERS.values():
        assert callable(method.builder())
        if method.page_bytes:
            assert callable(registry.resolve(method.page_bytes))
        if method.governor:
            assert callable(registry.resolve(method.governor))
        assert method.needs_model == bool(method.page_bytes)  # a model of its own keeps its KV in the pool
    assert proposer_method("draft_model") is PROPOSERS["draft"]  # vLLM's name
    with pytest.raises(ValueError, match="method must be one of ngram, suffix, draft"):
        proposer_method("medusa")


def test_the_registry_and_the_config_import_no_torch() -> None:
    code = "import sys, mechserve.api.config, mechserve.api.proposers, mechserve.cli.engine_args; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_no_method_name_is_compared_outside_the_registry() -> None:
    """Issue 25: the literal "draft" was compared in 6 files; now only the registry knows method names."""
    offenders = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        if rel in ("api/proposers.py",) or rel.startswith("spec/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                names = [c.value for c in (node.left, *node.comparators) if isinstance(c, ast.Constant)]
                sets = [
                    e.value
                    for c in node.comparators
                    if isinstance(c, ast.Tuple | ast.Set | ast.List)
                    for e in c.elts
                    if isinstance(e, ast.Constant)
                ]
                if any(n in PROPOSERS for n in [*names, *sets]):
                    offenders.append(f"{rel}:{node.lineno}")
    assert not offenders, offenders


class EchoProposer:
    """A model-free proposer written for this test: it guesses the request's last id again."""

    released: ClassVar[list[tuple[str, int]]] = []

    @classmethod
    def build(cls, ctx: ProposerContext) -> EchoProposer:
        return cls()

    def propose(self, windows: Sequence[Window]) -> list[Draft]:
        return [Draft((w.history[-1],) * w.slots) if w.slots else NO_DRAFT for w in windows]

    def available(self, request: ExecutorRequest, history: Sequence[int], cap: int) -> int:
        return cap

    def release(self, request: ExecutorRequest, output_ids: Sequence[int]) -> None:
        EchoProposer.released.append((request.request_id, len(output_ids)))


def core(tiny: Any, **config: Any) -> EngineCore:
    loaded = SimpleNamespace(model=tiny.model, tokenizer=None, eos_token_ids=(), path=None)
    return EngineCore(loaded, EngineConfig(page_size=4, num_pages=64, **config))


def test_a_model_free_proposer_is_one_entry(tiny: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    entry = ProposerMethod("echo", "repeat the last id", f"{__name__}:EchoProposer.build")
    monkeypatch.setitem(PROPOSERS, "echo", entry)  # type: ignore[index]
    prompts = random_prompts([7, 12, 5], seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=10)
    plain = core(tiny)
    for p in prompts:
        plain.add_request(p, params)
    want = {o.request_id: o.outputs[0].token_ids for o in plain.run_until_idle()}
    spec = SpeculativeConfig(method="echo", num_speculative_tokens=3, adaptive=False)
    echo = core(tiny, speculative=spec)
    for p in prompts:
        echo.add_request(p, params)
    got = {o.request_id: o.outputs[0].token_ids for o in echo.run_until_idle()}
    assert got == want  # speculation changes no greedy id
    stats = echo.stats(executor=True).executor
    assert stats is not None and stats.proposed > 0
    assert sorted(EchoProposer.released) == sorted(
        (rid, len(ids)) for rid, ids in want.items()
    )  # told each request's output
    with pytest.raises(ValueError, match="uses no model"):
        EngineConfig(speculative=SpeculativeConfig(method="echo", draft_model="smollm2:layers=1"))
