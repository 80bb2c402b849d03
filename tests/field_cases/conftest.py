"""The runtime half of the field-case audit: a ``test_bcNN_…`` test here must execute engine code.

While it runs, a profiler watches for the first call of a function defined in a ``mechserve`` module
that does work (not ``params``, ``outputs`` or the workload strategies); the test fails if none happens
(``notes_audit.executes``).  The static half is checked by ``test_field_case_coverage.py``.
"""

from __future__ import annotations

from notes.notes_audit import engine_file, executes

pytest_runtest_call = executes(engine_file)
