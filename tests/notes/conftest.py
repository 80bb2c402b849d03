"""The runtime half of the note-test audit: a note test must execute code of the rung it names.

While a test named ``test_mNN_n<k>_…`` runs, a profiler watches for the first call of a function
defined in ``mechserve/spec/mNN_*.py``; the test fails if none happens (``notes_audit.executes``).
The static half (it asserts, and it calls into the rung) is checked by ``test_note_coverage.py``.
"""

from __future__ import annotations

from notes.notes_audit import executes, rung_file

pytest_runtest_call = executes(rung_file)
