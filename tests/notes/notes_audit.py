"""What a test named after a note line or a field case does, read from its source (no test is run).

The meta-tests (``tests/notes/test_note_coverage.py``, ``tests/field_cases/test_field_case_coverage.py``)
used to match names only, so an empty ``def test_m04_n3_x(): pass`` satisfied them.  ``audit()`` reads
every ``test_*.py`` under ``tests/`` with ``ast`` and reports, for each test function:

* ``asserts``: its own body (nested functions and lambdas aside: a ``watch`` callback that only guards
  against a hung run is not a check) holds an ``assert``, a ``pytest.raises``/``pytest.fail``/
  ``pytest.warns``, a call of ``check_invariants`` or of a function whose name starts with ``assert``,
  or a call of a module-level helper that does so itself (transitively, e.g. m10's ``refused``);
* ``reaches``: the ``mechserve`` modules it calls into: a call whose callee is rooted at a name bound
  to ``mechserve`` (``m.Engine(...)``, ``R(...)`` with ``R = m.Request``, ``build(...)``), a module
  passed as an argument (``trace_of(m)``), a class built on one (``class Probe(m.Engine)``), and the
  same through the module-level helpers and classes it uses and the pytest fixtures it takes (its own
  module's or a ``conftest.py``'s on the way up to ``tests/``), transitively.  Decorators are not read:
  ``@given(workloads(...))`` draws data, it does not drive anything.

The runtime half is ``tests/notes/conftest.py`` (and ``tests/field_cases/conftest.py``): while a note
test runs, a profiler checks that code of the rung it names actually executes.
"""

from __future__ import annotations

import ast
import importlib
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

import mechserve
from mechserve.spec import RUNGS

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
NOTE_TEST = re.compile(r"test_m(\d\d)_n(\d+)_\w+")
CASE_TEST = re.compile(r"test_(bc\d\d)_\w+")
PYTEST_CHECKS = {"raises", "fail", "warns"}
PASSIVE = ("mechserve.api", "mechserve.conformance.strategies")
"""Modules a field-case test may call without that counting as driving an engine: they only hold or draw data."""


@dataclass
class Audited:
    path: Path
    name: str
    line: int
    asserts: bool
    reaches: frozenset[str]

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}::{self.name}"

    def reaches_module(self, module: str) -> bool:
        """True when the test calls into ``module`` (or something defined in it)."""
        return any(m == module or m.startswith(module + ".") for m in self.reaches)

    def reaches_an_engine(self) -> bool:
        """True when the test calls into some ``mechserve`` module that does work (not only data types)."""
        return any(not any(m == p or m.startswith(p + ".") for p in PASSIVE) for m in self.reaches)


def _root(node: ast.AST) -> str | None:
    """The name an attribute/call/subscript chain starts from: ``m`` for ``m.Engine(...).step``."""
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _walk_own(body: list[ast.stmt]) -> Iterator[ast.AST]:
    """Every node of ``body``, not descending into nested functions, lambdas or classes."""
    stack: list[ast.AST] = list(reversed(body))
    while stack:
        node = stack.pop()
        yield node
        for child in reversed(list(ast.iter_child_nodes(node))):
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                stack.append(child)


def _body_of(node: ast.AST) -> list[ast.AST]:
    """What a def contributes to what it reaches: its body (nested defs included), and a class's bases."""
    if isinstance(node, ast.ClassDef):
        return [*node.bases, *node.keywords, *node.body]
    assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    return [*node.args.defaults, *node.args.kw_defaults, *node.body]  # type: ignore[list-item]


def _used_names(nodes: list[ast.AST]) -> set[str]:
    """Names that are called (as the root of the callee), passed to a call, or used as a class base."""
    used: set[str] = set()
    for top in nodes:
        # a class base or a default value
        if isinstance(top, ast.expr) and not isinstance(top, ast.Call) and (name := _root(top)) is not None:
            used.add(name)
        for node in ast.walk(top):
            if isinstance(node, ast.ClassDef):
                used.update(n for b in node.bases if (n := _root(b)) is not None)
            if not isinstance(node, ast.Call):
                continue
            if (name := _root(node.func)) is not None:
                used.add(name)
            for arg in [*node.args, *(k.value for k in node.keywords)]:
                arg = arg.value if isinstance(arg, ast.Starred) else arg
                if isinstance(arg, (ast.Name, ast.Attribute)) and (name := _root(arg)) is not None:
                    used.add(name)
    return used


class Module:
    """One source file: its ``mechserve`` bindings, module-level defs and what each def reaches."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tree = ast.parse(path.read_text(), filename=str(path))
        self.defs: dict[str, ast.AST] = {}
        self.bound: dict[str, set[str]] = {}  # name -> mechserve modules/objects it stands for
        self.foreign: dict[str, tuple[Path, str]] = {}  # name -> (helper module under tests/, its name there)
        for node in self.tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.defs[node.name] = node
        for node in ast.walk(self.tree):  # imports anywhere count (some tests import inside the function)
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "mechserve":
                        self.bound.setdefault(alias.asname or alias.name.split(".")[0], set()).add(
                            alias.name if alias.asname else "mechserve"
                        )
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module.split(".")[0] == "mechserve":
                    for alias in node.names:
                        self.bound.setdefault(alias.asname or alias.name, set()).add(f"{node.module}.{alias.name}")
                elif (source := _test_module(path, node.module, 0)) is not None:
                    for alias in node.names:
                        self.foreign[alias.asname or alias.name] = (source, alias.name)
            elif (
                isinstance(node, ast.ImportFrom)
                and node.module
                and (source := _test_module(path, node.module, node.level)) is not None
            ):
                for alias in node.names:
                    self.foreign[alias.asname or alias.name] = (source, alias.name)
        # module-level aliases (R = m.Request, CACHE = m.CACHE), to a fixed point
        changed = True
        while changed:
            changed = False
            for node in self.tree.body:
                if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
                    continue
                refs = {n.id for n in ast.walk(node.value) if isinstance(n, ast.Name)}
                mods = set().union(*(self.bound.get(n, set()) for n in refs))
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    for name in (n.id for n in ast.walk(target) if isinstance(n, ast.Name)):
                        if mods - self.bound.get(name, set()):
                            self.bound.setdefault(name, set()).update(mods)
                            changed = True
        self._reach: dict[str, frozenset[str]] = {}
        self._asserts: dict[str, bool] = {}

    def reach(self, node: ast.AST, seen: frozenset[str] = frozenset()) -> frozenset[str]:
        """The mechserve modules ``node`` (a def) calls into, directly or through local defs and fixtures."""
        name = getattr(node, "name", "")
        if name in self._reach and self.defs.get(name) is node:
            return self._reach[name]
        used = _used_names(_body_of(node))
        found: set[str] = set()
        for n in used:
            found |= self.bound.get(n, set())
            if n in self.defs and n not in seen and self.defs[n] is not node:
                found |= self.reach(self.defs[n], seen | {name})
            elif n in self.foreign and n not in seen:
                source, there = self.foreign[n]
                helper = module(source)
                found |= helper.bound.get(there, set())
                if there in helper.defs:
                    found |= helper.reach(helper.defs[there], seen | {n})
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for arg in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]:
                found |= fixture_reach(self.path, arg.arg, seen | {name})
        result = frozenset(found)
        if self.defs.get(name) is node and not seen:
            self._reach[name] = result
        return result

    def asserts(self, node: ast.AST, seen: frozenset[str] = frozenset()) -> bool:
        """True when ``node``'s own body checks something (see the module docstring)."""
        name = getattr(node, "name", "")
        if name in self._asserts and self.defs.get(name) is node:
            return self._asserts[name]
        result = False
        body = node.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else []
        for sub in _walk_own(body):
            if isinstance(sub, ast.Assert):
                result = True
            elif isinstance(sub, ast.Call):
                callee = sub.func
                attr = callee.attr if isinstance(callee, ast.Attribute) else getattr(callee, "id", "")
                pytest_check = isinstance(callee, ast.Attribute) and _root(callee) == "pytest" and attr in PYTEST_CHECKS
                if pytest_check or attr == "check_invariants" or attr.startswith("assert"):
                    result = True
                elif isinstance(callee, ast.Name) and callee.id in self.defs and callee.id not in seen:
                    result = self.asserts(self.defs[callee.id], seen | {name})
            if result:
                break
        if self.defs.get(name) is node and not seen:
            self._asserts[name] = result
        return result


def _test_module(path: Path, dotted: str, level: int) -> Path | None:
    """The file under ``tests/`` that ``from <dotted> import ...`` in ``path`` loads, if it is one."""
    if level:
        base = path.parent
        for _ in range(level - 1):
            base = base.parent
        candidates = [base.joinpath(*dotted.split(".")).with_suffix(".py")]
    else:
        candidates = [folder.joinpath(*dotted.split(".")).with_suffix(".py") for folder in (path.parent, TESTS)]
    return next((c for c in candidates if c.is_file() and TESTS in c.parents), None)


@cache
def module(path: Path) -> Module:
    return Module(path)


def _conftests(path: Path) -> Iterator[Path]:
    """The ``conftest.py`` files that can serve fixtures to a test in ``path``, nearest first."""
    folder = path.parent
    while True:
        if (folder / "conftest.py").is_file():
            yield folder / "conftest.py"
        if folder == TESTS or folder == folder.parent:
            return
        folder = folder.parent


def fixture_reach(path: Path, name: str, seen: frozenset[str]) -> frozenset[str]:
    """What the fixture ``name``, as a test in ``path`` would receive it, calls into (empty: no fixture)."""
    for source in (path, *_conftests(path)):
        mod = module(source)
        node = mod.defs.get(name)
        if node is not None and any("fixture" in ast.unparse(d) for d in getattr(node, "decorator_list", [])):
            return mod.reach(node, seen | {f"fixture:{name}"}) if f"fixture:{name}" not in seen else frozenset()
    return frozenset()


def audit(pattern: re.Pattern[str]) -> list[Audited]:
    """Every test function under ``tests/`` whose name matches ``pattern``, with what it does."""
    found = []
    for path in sorted(TESTS.rglob("test_*.py")):
        if pattern.search(path.read_text()) is None:
            continue
        mod = module(path)
        tops = [n for n in mod.tree.body if isinstance(n, ast.ClassDef)]
        candidates = [*mod.tree.body, *(n for c in tops for n in c.body)]
        for node in candidates:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and pattern.fullmatch(node.name):
                found.append(Audited(path, node.name, node.lineno, mod.asserts(node), mod.reach(node)))
    return found


# ---- the runtime half: did the test execute the code it is named after? ----------------------------------


Target = tuple[str, Callable[[str], bool]]
"""What a test must execute: a description, and a predicate on a code object's file name."""


def executes(target: Callable[[str], Target | None]) -> Callable[..., Any]:
    """A ``pytest_runtest_call`` hook wrapper for a ``conftest.py``.

    ``target(test_name)`` gives the code the test must run, or None for a test that is not audited.
    While the test's call phase runs, ``sys.setprofile`` watches for a Python call into that code and
    switches itself off at the first one; if none happens and the test passed, it fails instead.
    """

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(item: pytest.Item) -> Any:
        wanted = target(item.name)
        if wanted is None:
            return (yield)
        what, matches = wanted
        previous = sys.getprofile()
        hit = False

        def watch(frame: FrameType, event: str, arg: object) -> None:
            nonlocal hit
            if event == "call" and matches(frame.f_code.co_filename):
                hit = True
                sys.setprofile(previous)

        sys.setprofile(watch)
        try:
            result = yield
        finally:
            sys.setprofile(previous)
        if not hit:
            pytest.fail(f"{item.nodeid} passed without ever calling into {what}", pytrace=False)
        return result

    return pytest_runtest_call


MECHSERVE = Path(mechserve.__file__).parent  # as imported: code objects carry the same file names


def rung_file(name: str) -> Target | None:
    """For a note test ``test_mNN_n<k>_…``: the rung it names, ``mechserve/spec/mNN_*.py``."""
    m = NOTE_TEST.match(name)
    if m is None or int(m.group(1)) >= len(RUNGS):
        return None
    rung = f"mechserve.spec.{RUNGS[int(m.group(1))]}"
    path = importlib.import_module(rung).__file__
    return rung, lambda filename: filename == path


def engine_file(name: str) -> Target | None:
    """For a field-case test ``test_bcNN_…``: any ``mechserve`` module that does work (not only data types)."""
    if CASE_TEST.match(name) is None:
        return None
    root = str(MECHSERVE) + "/"
    passive = tuple(str(MECHSERVE.joinpath(*p.split(".")[1:])) for p in PASSIVE)
    return (
        "mechserve (beyond params, outputs and strategies)",
        lambda f: f.startswith(root) and not f.startswith(passive),
    )
