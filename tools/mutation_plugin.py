"""pytest plugin for mutation runs: fewer hypothesis examples per mutant, the fastest tests first.

``tools/mutation.py`` copies this file into each module's scratch copy (beside ``pyproject.toml``, so
mutmut copies it into ``mutants/``, which is on ``sys.path``) and loads it with ``-p mutation_plugin``
in every pytest run mutmut starts: the statistics run, the clean run and each mutant's run.

* ``--mutation-max-examples N`` (N > 0): every hypothesis test runs at most N examples
  (fewer if its own ``@settings`` asks for fewer), derandomized (the same examples in every run, so a
  verdict can be reproduced) and without the example database (one mutant's failing example is not
  replayed against the next).  The property tests stay in the selection; they only try fewer inputs.
  A mutant that survives this is run again with the tests' own example counts before it is reported
  (``tools/mutation.py``: ``rerun_survivors``), so no mutant the tests' own counts kill is reported
  as a survivor because of the cap.
  Absent or 0: the tests' own settings, untouched.  An option, not an environment variable, so that
  it is part of mutmut's configuration fingerprint: cached verdicts taken with another cap are redone.
* The fastest tests first: the items are ordered by the call durations mutmut recorded in its
  statistics run (``mutmut-stats.json`` in the current directory, which is ``mutants/`` while mutmut
  runs tests), as mutmut's ``fork`` runner orders them itself; its ``forkserver`` runner (the torch
  modules) hands the tests over in set order.  With ``-x`` a killed mutant stops at its first failing
  test, so the cheap ones should come first.  Tests mutmut has no duration for keep their place, last.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

STATS = Path("mutmut-stats.json")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--mutation-max-examples",
        type=int,
        default=0,
        help="at most this many hypothesis examples per test, derandomized, no database (0: the tests' own)",
    )


def cap_examples(items: list[pytest.Item], cap: int) -> int:
    """Give every hypothesis test among ``items`` at most ``cap`` examples, derandomized, no database.

    Hypothesis reads a test's settings from ``_hypothesis_internal_use_settings`` when the test runs,
    and an explicit ``@settings(max_examples=...)`` outranks any profile, so the settings object itself
    is replaced (a new one whose parent is the test's own).  Returns how many tests were capped;
    raises ``RuntimeError`` if a hypothesis test lacks that attribute (a hypothesis that no longer
    keeps it there would otherwise leave every test uncapped without a word).
    """
    from hypothesis import settings

    done: set[int] = set()
    for item in items:
        fn: Any = getattr(item, "obj", None)
        fn = getattr(fn, "__func__", fn)
        if not getattr(fn, "is_hypothesis_test", False) or id(fn) in done:
            continue
        own = getattr(fn, "_hypothesis_internal_use_settings", None)
        if own is None:
            raise RuntimeError(f"{item.nodeid}: hypothesis keeps no settings where mutation_plugin looks for them")
        fn._hypothesis_internal_use_settings = settings(
            own, max_examples=min(own.max_examples, cap), derandomize=True, database=None
        )
        done.add(id(fn))
    return len(done)


def fastest_first(items: list[pytest.Item], durations: dict[str, float]) -> None:
    """Order ``items`` in place by ``durations`` (seconds by node id), unknown ones last in their order."""
    items.sort(key=lambda item: durations.get(item.nodeid, math.inf))


def _durations() -> dict[str, float]:
    if not STATS.exists():  # mutmut's statistics run itself
        return {}
    return {k: float(v) for k, v in json.loads(STATS.read_text())["duration_by_test"].items()}


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    cap = config.getoption("--mutation-max-examples")
    if cap < 0:
        raise pytest.UsageError(f"--mutation-max-examples must be >= 0, not {cap}")
    if cap:
        cap_examples(items, cap)
    fastest_first(items, _durations())
