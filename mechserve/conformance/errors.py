"""What a failed conformance check raises: one exception type per check, each with a one-line message.

``ContractViolation`` is the boundary's own error (a ``BoundaryViolation`` of m12), so an engine that
meets it commits nothing of the step; the others are ``ConformanceError``s raised by the checkers
after (or between) steps.  Standard library only.
"""

from __future__ import annotations

from typing import Any

from mechserve.spec.m16_request_draft_lengths import BoundaryViolation


class ConformanceError(Exception):
    """A conformance check found a difference; the message names the check, the step and the field."""


class ContractViolation(BoundaryViolation):
    """An executor broke the boundary contract, measured on its answer and on the KV tensors it wrote.

    Raised from inside ``execute`` before the engine sees the outcomes, so (N15) nothing of the step
    is committed.
    """


class ReplayMismatch(ConformanceError):
    """The spec, replaying a real run's verdicts and ids, produced a different trace.

    ``step`` is the first differing step (``None`` for the end state), ``field`` the first differing
    field of it, ``real``/``replay`` the two values.
    """

    def __init__(self, step: int | None, field: str, real: Any, replay: Any) -> None:
        where = "end state" if step is None else f"step {step}"
        super().__init__(f"first difference: {where}, field {field}: real={real!r} replay={replay!r}")
        self.step = step
        self.field = field
        self.real = real
        self.replay = replay


class KVMismatch(ConformanceError):
    """K/V read back through a page table differ from a dense forward over the same tokens."""


class InvarianceMismatch(ConformanceError):
    """Greedy output under some engine configuration differs from the request generated alone."""


class LadderMismatch(ConformanceError):
    """A rung with its new mechanism idle produced a different trace than the rung below."""
