"""Check 5, ladder consistency, on the spec alone: a rung whose new mechanism is idle is the rung below.

For every rung ``m01`` … ``m13`` and a workload drawn by ``strategies.mechanism_idle(rung)`` (the knobs
under which that rung's mechanism changes nothing: a covering budget for m02/m04, an ample pool for
m03/m05, no shared first blocks and an ample pool for m08, ``spec_len`` 0 for m09, requests that all
pass the door and arrive in list order for m12 (whose first-come-first-served order, D9, is then m11's
list order), output caching off for m13, nothing at all for the purely structural rungs),
the rung and the rung below
run the same workload with their built-in scripted executors.  They must agree on every field the
lower rung has, and end the same way (the same error type at the same step, or none).  Where the
upper rung adds fields, they must be idle too: m09's ``drafted``/``accepted``/``rolled_back`` all 0,
m12's ``rejected``/``aborted`` empty (m10's ``tokens`` is new information, not a mechanism).
Standard library and hypothesis only.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from mechserve.conformance.errors import LadderMismatch
from mechserve.conformance.strategies import build, cli_valid
from mechserve.spec import RUNGS

PAIRS: tuple[tuple[str, str], ...] = tuple(zip(RUNGS[1:], RUNGS[:-1]))
"""``(upper, lower)`` for every rung above m00, bottom up."""


def _module(name: str, modules: Mapping[str, ModuleType] | None) -> ModuleType:
    if modules is not None and name in modules:
        return modules[name]
    return importlib.import_module(f"mechserve.spec.{name}")


def _run(module: ModuleType, workload: Mapping[str, Any]) -> tuple[list[dict[str, Any]], str | None]:
    """The trace (``to_json`` per record, also those before an error) and the error type name, or None."""
    records: list[dict[str, Any]] = []
    try:
        engine = build(module, workload, validate=cli_valid(workload))
        engine.run(on_step=lambda rec: records.append(rec.to_json()))
    except Exception as exc:  # compared, not raised: both rungs must fail alike
        return records, type(exc).__name__
    return records, None


def check_ladder_pair(
    upper: str, workload: Mapping[str, Any], *, modules: Mapping[str, ModuleType] | None = None
) -> dict[str, Any]:
    """Check 5 for rung ``upper`` (a ``RUNGS`` name above m00) and the rung below it on one workload.

    ``modules`` may replace rung modules by name (to check a modified rung).  Raises
    ``LadderMismatch`` at the first difference; returns ``{"runs": 2, "steps": …}``.
    """
    i = RUNGS.index(upper)
    if i == 0:
        raise ValueError("m00 has no rung below it")
    lower = RUNGS[i - 1]
    hi, hi_error = _run(_module(upper, modules), workload)
    lo, lo_error = _run(_module(lower, modules), workload)
    u, lname = upper[:3], lower[:3]
    for k in range(max(len(hi), len(lo))):
        if k >= len(hi) or k >= len(lo):
            raise LadderMismatch(
                f"ladder: {u} vs {lname}: {u} ran {len(hi)} step(s) ({hi_error or 'finished'}), "
                f"{lname} ran {len(lo)} ({lo_error or 'finished'})"
            )
        for name, value in lo[k].items():
            if hi[k].get(name) != value:
                raise LadderMismatch(
                    f"ladder: {u} vs {lname}: first difference: step {k}, field {name}: "
                    f"{u}={hi[k].get(name)!r} {lname}={value!r}"
                )
        for name in ("drafted", "accepted", "rolled_back"):
            if name not in lo[k] and any(hi[k].get(name, {}).values()):
                raise LadderMismatch(f"ladder: {u} vs {lname}: step {k}: idle speculation has {name} {hi[k][name]}")
        for name in ("rejected", "aborted"):
            if name not in lo[k] and hi[k].get(name):
                raise LadderMismatch(f"ladder: {u} vs {lname}: step {k}: {name} {hi[k][name]} with the door idle")
    if hi_error != lo_error:
        raise LadderMismatch(f"ladder: {u} vs {lname}: {u} ended with {hi_error}, {lname} with {lo_error}")
    return {"runs": 2, "steps": len(lo)}
