"""Conformance: checking that an executor, run under the spec, behaves as the spec says.

Five checks (``docs/executors.md`` has the guide)::

    replay      the real run's trace is the spec's trace for the same verdicts and ids
    contract    every step, the executor wrote exactly the planned slots and answered within the boundary
    kv          K/V read back through every page table equal a dense forward over the same tokens
    invariance  greedy output is the same under every engine configuration, and equals the reference
    ladder      (spec only) each rung with its new mechanism idle equals the rung below

Entry points (imported lazily, so ``mechserve.conformance.strategies`` never pulls in torch)::

    check_executor(target, workloads=N, seed=S, checks=CHECKS) -> Report       all checks, random workloads
    Target(...), torch_target(model, hf=...), tiny_target(), load_target(name)  the executor under test
    check_replay / check_contract / check_kv / check_invariance (target, workload), check_ladder_pair(rung, workload)
    CheckedExecutor, ReplayExecutor, KVAuditor, run_workload                     the parts, for your own harness
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CHECKS": "suite",
    "CheckResult": "suite",
    "Failure": "suite",
    "Report": "suite",
    "check_executor": "suite",
    "Target": "target",
    "torch_target": "target",
    "tiny_target": "target",
    "tiny_model": "target",
    "load_target": "target",
    "cache_tensors": "target",
    "check_replay": "replay",
    "ReplayExecutor": "replay",
    "compare": "replay",
    "check_contract": "contract",
    "CheckedExecutor": "contract",
    "check_kv": "kv_audit",
    "KVAuditor": "kv_audit",
    "check_invariance": "invariance",
    "VARIANTS": "invariance",
    "check_ladder_pair": "ladder",
    "PAIRS": "ladder",
    "run_workload": "runner",
    "build_engine": "runner",
    "RealRun": "runner",
    "model_workload": "cases",
    "real_workloads": "cases",
    "invariance_workloads": "cases",
    "FIXED_WORKLOADS": "cases",
    "ConformanceError": "errors",
    "ContractViolation": "errors",
    "ReplayMismatch": "errors",
    "KVMismatch": "errors",
    "InvarianceMismatch": "errors",
    "LadderMismatch": "errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mechserve.conformance' has no attribute {name!r}")
    return getattr(importlib.import_module(f"mechserve.conformance.{module}"), name)
