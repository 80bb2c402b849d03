"""Mutation testing of the modules whose bugs would hurt most, one module at a time (issue 20).

Each module runs mutmut 3 in its own scratch copy of the worktree (``build/mutation/<name>/``,
ignored by git) with a ``[tool.mutmut]`` table written for that module alone: ``only_mutate`` names
the one file and ``pytest_add_cli_args_test_selection`` the tests that own it, so a mutant of the
detokenizer never waits on the engine's suite.  Inside that selection mutmut's own trampolines map
each mutated function to the tests that call it, and each mutant runs only those (stopping at the
first failure).  One worker (``--max-children 1``): the machine is shared.

    python tools/mutation.py                       # every module, smallest first
    python tools/mutation.py verify detokenizer    # just these
    python tools/mutation.py m13 --sample 0.25     # a seeded quarter of the top rung's mutants (default: 0.1)
    python tools/mutation.py --list                # the modules and their tests

Each run writes ``build/mutation/<name>/summary.json`` (counts and the surviving mutants with their
diffs); ``--report`` prints the Markdown table docs/mutation.md starts from.  Reruns start from a
fresh scratch copy (``--keep`` reuses mutmut's cache in it instead).
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRATCH = ROOT / "build" / "mutation"
MUTMUT = Path(sys.executable).with_name("mutmut")


@dataclass(frozen=True)
class Module:
    """One module under mutation: its source file and the tests that own it (pytest arguments)."""

    name: str
    path: str
    tests: tuple[str, ...]
    # More pytest arguments for this module's runs (e.g. tests deselected: too slow for every mutant).
    pytest_args: tuple[str, ...] = ()
    # torch's thread pools are not fork-safe once started; those suites fork from a clean server.
    forkserver: bool = False
    # The fraction of the module's mutants `make mutation` runs (seeded): whole modules where that fits
    # the hour, a sample of the three whose mutants each run engines (docs/mutation.md, "Time").
    sample: float = 1.0


FAST = ("-m", "not slow and not gpu", "-p", "no:cacheprovider")

# The HTTP layer's translation and refusals, at the model level (no server: a served check per mutant would
# take minutes); the request-capturing server test and tests/http/test_fields.py's served walk run in the
# ordinary suite.
HTTP_MODEL_TESTS = (
    "tests/http/test_field_layer.py",
    "tests/http/test_fields.py::test_the_docs_are_the_table_rendered",
    "tests/http/test_fields.py::test_the_request_models_declare_exactly_the_honoured_fields",
    "tests/http/test_fields.py::test_every_row_is_complete_and_names_are_unique_per_endpoint",
)
HTTP_NO_SERVER = ("--deselect", "tests/http/test_field_layer.py::test_the_engine_receives_the_view")

# Smallest first, so the report has something in it early.
MODULES: tuple[Module, ...] = (
    Module(
        "verify",
        "mechserve/executor/verify.py",
        ("tests/executor/test_spec_sampling.py",),
        forkserver=True,
    ),
    Module(
        "detokenizer",
        "mechserve/engine/detokenizer.py",
        ("tests/engine/test_detokenizer.py", "tests/engine/test_stop_strings.py"),
    ),
    Module(
        "fields",
        "mechserve/http/fields.py",
        HTTP_MODEL_TESTS,
        HTTP_NO_SERVER,
    ),
    Module(
        "protocol",
        "mechserve/http/protocol.py",
        HTTP_MODEL_TESTS,
        HTTP_NO_SERVER,
    ),
    Module(
        "paged",
        "mechserve/kv/paged.py",
        ("tests/kv/test_native_attention.py", "tests/executor/test_torch_executor.py"),
        forkserver=True,
        sample=0.1,
    ),
    Module(
        "sampling",
        "mechserve/executor/sampling.py",
        (
            "tests/executor/test_sampling.py",
            "tests/executor/test_penalties.py",
            "tests/executor/test_spec_sampling.py",
        ),
        forkserver=True,
        sample=0.1,
    ),
    Module(
        "m13",
        "mechserve/spec/m13_output_caching.py",
        (
            "tests/notes/test_m13_output_caching.py",
            "tests/property/test_m13_properties.py",
            "tests/property/test_m13_edges.py",
        ),
        sample=0.1,
    ),
)
BY_NAME = {m.name: m for m in MODULES}

# mutmut's exit-code verdicts (mutmut.models: status_by_exit_code), grouped for the report.
KILLED = {"killed", "timeout", "segfault", "caught by type check"}
SURVIVED = {"survived", "suspicious"}


def _toml_list(items: tuple[str, ...] | list[str]) -> str:
    return "[" + ", ".join(json.dumps(x) for x in items) + "]"


def _prepare(mod: Module, keep: bool) -> Path:
    """A scratch copy of mechserve/, tests/, docs/ and pyproject.toml with this module's [tool.mutmut] table."""
    work = SCRATCH / mod.name
    if work.exists() and not keep:
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis")
    for d in ("mechserve", "tests", "docs"):
        shutil.copytree(ROOT / d, work / d, dirs_exist_ok=True, ignore=ignore)
    table = "\n".join(
        [
            "",
            "[tool.mutmut]",
            'source_paths = ["mechserve"]',
            f"only_mutate = {_toml_list([mod.path])}",
            f"pytest_add_cli_args_test_selection = {_toml_list(list(mod.tests))}",
            f"pytest_add_cli_args = {_toml_list([*FAST, *mod.pytest_args])}",
            f'process_isolation = "{"forkserver" if mod.forkserver else "fork"}"',
            "use_git_change_detection = false",
            'also_copy = ["docs"]',  # tests/http/test_fields.py compares docs/api-fields.md with the table
            "",
        ]
    )
    (work / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text() + table)
    return work


def _env() -> dict[str, str]:
    env = dict(os.environ)
    # The worktree must not shadow the mutated copy mutmut puts first on sys.path.
    env.pop("PYTHONPATH", None)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return env


def _mutmut(work: Path, *args: str, capture: bool = False) -> subprocess.CompletedProcess[str]:
    """Run mutmut in ``work``; its progress spinner goes to ``work/mutmut.log`` unless captured."""
    if capture:
        return subprocess.run([str(MUTMUT), *args], cwd=work, env=_env(), text=True, capture_output=True, check=False)
    with open(work / "mutmut.log", "a") as log:
        return subprocess.run(
            [str(MUTMUT), *args], cwd=work, env=_env(), text=True, stdout=log, stderr=log, check=False
        )


def _statuses(work: Path) -> dict[str, str]:
    out = _mutmut(work, "results", "--all", "true", capture=True).stdout
    found = {}
    for line in out.splitlines():
        m = re.match(r"\s+(\S+): (.+)$", line)
        if m:
            found[m.group(1)] = m.group(2).strip()
    return found


_DIFFS = """
import json, sys
from mutmut.mutation.diff_apply import get_diff_for_mutant
path, names = sys.argv[1], json.loads(sys.stdin.read())
print(json.dumps({n: get_diff_for_mutant(n, path=path) for n in names}))
"""


def _diffs(work: Path, mod: Module, names: list[str]) -> dict[str, str]:
    """Each mutant's diff, all in one process (``mutmut show`` starts one per mutant)."""
    if not names:
        return {}
    proc = subprocess.run(
        [sys.executable, "-c", _DIFFS, mod.path],
        cwd=work,
        env=_env(),
        input=json.dumps(names),
        text=True,
        capture_output=True,
        check=True,
    )
    return dict(json.loads(proc.stdout))


def _probe(mod: Module) -> str:
    """One mutant's name (the first top-level function's first mutant): running it generates them all."""
    tree = ast.parse((ROOT / mod.path).read_text())
    first = next(n.name for n in tree.body if isinstance(n, ast.FunctionDef))
    return f"*.x_{first}__mutmut_1"


def _all_mutant_names(work: Path, mod: Module) -> list[str]:
    """Every mutant mutmut generates for the module (read from its .meta file after generation)."""
    meta = work / "mutants" / (mod.path + ".meta")
    if not meta.exists():
        return []
    return sorted(json.loads(meta.read_text())["exit_code_by_key"])


def run_module(mod: Module, *, sample: float, seed: int, keep: bool) -> dict[str, object]:
    work = _prepare(mod, keep)
    started = time.monotonic()
    names: list[str] = []
    if sample < 1.0:
        # Generate the mutants (and collect stats) running one mutant only, then
        # draw the seeded sample from the full list and run it.
        first = _mutmut(work, "run", "--max-children", "1", _probe(mod))
        if first.returncode != 0:
            raise SystemExit(f"mutmut failed generating {mod.name}'s mutants (exit {first.returncode})")
        everyone = _all_mutant_names(work, mod)
        rng = random.Random(seed)
        names = sorted(rng.sample(everyone, max(1, round(sample * len(everyone)))))
    proc = _mutmut(work, "run", "--max-children", "1", *names)
    if proc.returncode != 0:
        raise SystemExit(f"mutmut failed on {mod.name} (exit {proc.returncode}); see {work / 'mutmut.log'}")
    return summarise(mod, work, names, sample=sample, seed=seed, wall=time.monotonic() - started)


def summarise(
    mod: Module, work: Path, names: list[str], *, sample: float, seed: int, wall: float, partial: bool = False
) -> dict[str, object]:
    """Count the verdicts in ``work`` (of ``names`` when sampled) and keep each survivor's diff."""
    statuses = _statuses(work)
    if names:
        statuses = {k: v for k, v in statuses.items() if k in set(names)}
    counts: dict[str, int] = {}
    for v in statuses.values():
        counts[v] = counts.get(v, 0) + 1
    survivors = sorted(k for k, v in statuses.items() if v in SURVIVED or v == "no tests")
    diffs = _diffs(work, mod, survivors)
    total_generated = len(_all_mutant_names(work, mod))
    summary: dict[str, object] = {
        "module": mod.path,
        "tests": list(mod.tests),
        "generated": total_generated,
        "run": len(statuses),
        "sample": sample,
        "seed": seed,
        "killed": sum(n for s, n in counts.items() if s in KILLED),
        "survived": sum(n for s, n in counts.items() if s in SURVIVED),
        "no_tests": counts.get("no tests", 0),
        "not_checked": counts.get("not checked", 0),
        "statuses": counts,
        "wall_s": round(wall, 1),
        "partial": partial,
        "survivors": diffs,
    }
    (work / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def rerun_survivors(mod: Module) -> dict[str, object]:
    """Run the last full run's survivors again against today's tests (fresh copy, fresh stats); record the result."""
    f = SCRATCH / mod.name / "summary.json"
    summary = json.loads(f.read_text())
    names = sorted(summary["survivors"])
    again: dict[str, str] = {}
    if names:
        work = _prepare(Module(mod.name + "-rerun", mod.path, mod.tests, mod.pytest_args, mod.forkserver), keep=False)
        proc = _mutmut(work, "run", "--max-children", "1", *names)
        if proc.returncode != 0:
            raise SystemExit(f"mutmut failed re-running {mod.name} (exit {proc.returncode}); see {work / 'mutmut.log'}")
        again = {k: v for k, v in _statuses(work).items() if k in set(names)}
    summary["rerun"] = again
    summary["still_surviving"] = sorted(k for k, v in again.items() if v not in KILLED)
    f.write_text(json.dumps(summary, indent=1))
    return summary


def report() -> str:
    rows = [
        "| module | test files or ids | killed / run (generated) | killed by the first run | score | wall |",
        "|---|---|---|---|---|---|",
    ]
    for mod in MODULES:
        f = SCRATCH / mod.name / "summary.json"
        if not f.exists():
            rows.append(f"| `{mod.path}` | — | not run | | | |")
            continue
        s = json.loads(f.read_text())
        run = s["run"] - s["not_checked"]
        killed = s["killed"]
        if "rerun" in s:  # survivors of the full run that the tests written since kill
            killed += sum(1 for v in s["rerun"].values() if v in KILLED)
        score = 100.0 * killed / run if run else 0.0
        sampled = f", sample {s['sample']:.0%} seed {s['seed']}" if s["sample"] < 1 else ""
        if s.get("partial"):
            sampled += ", interrupted: the first mutants in file order"
        rows.append(
            f"| `{mod.path}` | {len(s['tests'])} | {killed} / {run} ({s['generated']} generated{sampled}) "
            f"| {s['killed']} | {score:.1f}% | {s['wall_s'] / 60:.1f} min |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("modules", nargs="*", help=f"any of {', '.join(BY_NAME)} (default: all, smallest first)")
    ap.add_argument("--sample", type=float, default=None, help="fraction of mutants to run (seeded)")
    ap.add_argument("--seed", type=int, default=20)
    ap.add_argument("--keep", action="store_true", help="reuse the scratch copy and mutmut's cache")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--report", action="store_true", help="print the Markdown table of the last runs")
    ap.add_argument("--collect", action="store_true", help="summarise an interrupted run from mutmut's cache")
    ap.add_argument(
        "--rerun-survivors", action="store_true", help="run the last full run's survivors against the current tests"
    )
    args = ap.parse_args(argv)
    if args.list:
        for m in MODULES:
            print(f"{m.name:12} {m.path:40} {' '.join(m.tests)}")
        return 0
    if args.report:
        print(report())
        return 0
    unknown = [n for n in args.modules if n not in BY_NAME and not any(fnmatch.fnmatch(m, n) for m in BY_NAME)]
    if unknown:
        print(f"mutation: unknown module {unknown[0]!r} (one of {', '.join(BY_NAME)})", file=sys.stderr)
        return 2
    chosen = [m for m in MODULES if not args.modules or m.name in args.modules]
    if args.collect:
        for mod in chosen:
            work = SCRATCH / mod.name
            wall = (work / "mutmut.log").stat().st_mtime - (work / "pyproject.toml").stat().st_mtime
            summarise(mod, work, [], sample=1.0, seed=args.seed, wall=wall, partial=True)
        print(report())
        return 0
    if args.rerun_survivors:
        for mod in chosen:
            s = rerun_survivors(mod)
            print(
                f"mutation: {mod.name}: {len(s['rerun'])} survivors re-run, {len(s['still_surviving'])} still survive"
            )
        print(report())
        return 0
    for mod in chosen:
        sample = args.sample if args.sample is not None else mod.sample
        s = run_module(mod, sample=sample, seed=args.seed, keep=args.keep)
        print(
            f"mutation: {mod.name}: killed {s['killed']} / {s['run']} "
            f"(survived {s['survived']}, no tests {s['no_tests']}) in {s['wall_s']} s",
            flush=True,
        )
    print(report())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
