"""The native suffix trie (``csrc/suffix_tree.cpp``) against the pure-Python one, its reference.

Side by side on random operations: the same nodes (the native tree allocates and reuses node ids exactly as
the Python one, so even the ids agree), children and counts, matches, matchers and drafts (ids, score to
the last bit, match length); two proposers, one per implementation, fed the same calls draft the same.
Then ``MECHSERVE_SUFFIX_TREE`` (``auto``/``native``/``python``) and the native memory given back.
test_spec_suffix.py runs every suffix test on both implementations as well.
"""

from __future__ import annotations

import copy
import gc
import os
import pickle
import subprocess
import sys
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mechserve.api.errors import NativeKernelError
from mechserve.api.params import SamplingParams
from mechserve.executor import suffix_native
from mechserve.executor.proposers import Window
from mechserve.executor.proposers_suffix import (
    MAX_TOKEN_ID,
    NATIVE_MAX_DEPTH,
    ROOT,
    Match,
    Matcher,
    NativeMatcher,
    NativeSuffixTree,
    SuffixProposer,
    SuffixTree,
    best_draft,
    native_best_draft,
)
from mechserve.executor.request import ExecutorRequest
from mechserve.executor.sampling import Row


@contextmanager
def mode(value: str) -> Iterator[None]:
    with mock.patch.dict(os.environ, {"MECHSERVE_SUFFIX_TREE": value}):
        yield


def proposer(value: str, **options: Any) -> SuffixProposer:
    with mode(value):
        made = SuffixProposer(**options)
    assert made.native == (value == "native")
    return made


def same_trees(py: SuffixTree, nat: NativeSuffixTree) -> None:
    """The same nodes under the same ids: children (token -> node id), counts, outs and best children."""
    assert py.nodes == nat.nodes
    stack = [ROOT]
    seen = 0
    while stack:
        node = stack.pop()
        seen += 1
        kids = py.children(node)
        assert nat.children(node) == kids
        assert (nat.count[node], nat.out[node], nat.best[node]) == (py.count[node], py.out[node], py.best[node])
        for t, c in kids.items():
            assert nat.child(node, t) == c and nat.token[c] == t
        stack.extend(kids.values())
    assert seen == py.nodes
    assert nat._top == py._top and nat._free == list(py._free)


# few ids, so that text repeats; sometimes more, so that nodes pass the native tree's 8 children, from where
# its hash map finds them (and come back down to 4, where their chain does again)
alphabet = st.one_of(st.sampled_from([0, 1, 2, 3, 3, 2, -1, MAX_TOKEN_ID]), st.integers(4, 16))
ids_of = st.lists(alphabet, max_size=12)
params = st.tuples(
    st.integers(0, 7),  # num
    st.sampled_from([0.5, 1.0, 1.5, 2.5, 7.0]),  # max_spec_factor
    st.sampled_from([0.0, 0.1, 0.25, 1 / 3, 0.5, 1.0]),  # min_token_prob
    st.one_of(st.none(), st.tuples(st.floats(0, 4), st.integers(0, 6))),  # beat: score, match length
)
tree_ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), ids_of),
        # grow cursor k by ids, one at a time or in one extend
        st.tuples(st.just("append"), st.integers(0, 3), st.lists(alphabet, min_size=1, max_size=8), st.booleans()),
        st.tuples(st.just("remove"), st.integers(0, 20)),  # take out the i-th sequence held (mod their number)
        # matcher j's history grows by ids (a rollback cuts it first: the matcher must find its nodes afresh)
        st.tuples(st.just("match"), st.integers(0, 1), st.integers(0, 3), ids_of, st.booleans(), params),
        st.tuples(st.just("draft"), ids_of, params),
        st.tuples(st.just("big"), st.integers(0, 3)),  # an id above MAX_TOKEN_ID: refused by both
    ),
    max_size=40,
)


def same_draft(py: SuffixTree, nat: NativeSuffixTree, py_matched: list[int], nat_matched: list[int], p: Any) -> None:
    num, factor, min_prob, beat = p
    rival = None if beat is None else Match((9,), *beat)
    want = best_draft(py, py_matched, num, factor, min_prob, rival)
    got = native_best_draft(nat, nat_matched, num, factor, min_prob, rival)
    assert got == want and got.score.hex() == float(want.score).hex()  # ids, score to the last bit, length
    if rival is not None and want is rival:
        assert got is rival


@settings(max_examples=300, deadline=None, database=None)
@given(ops=tree_ops, depth=st.integers(2, 7))
def test_the_native_tree_is_the_python_tree_step_for_step(ops: list[tuple[Any, ...]], depth: int) -> None:
    py, nat = SuffixTree(depth), NativeSuffixTree(depth)
    held: list[list[int]] = []
    cursors: dict[int, tuple[Any, Any, list[int]]] = {}  # k -> the Python cursor, the native one, its ids
    matchers = [(Matcher(py), NativeMatcher(nat), []) for _ in range(2)]  # and each one's history
    for op in ops:
        if op[0] == "add":
            py.add(op[1])
            nat.add(op[1])
            held.append(list(op[1]))
        elif op[0] == "append":
            if op[1] not in cursors:
                cursors[op[1]] = (py.cursor(), nat.cursor(), [])
                held.append(cursors[op[1]][2])
            pc, nc, seq = cursors[op[1]]
            if op[3]:
                nc.extend(op[2])
            else:
                for t in op[2]:
                    nc.append(t)
            for t in op[2]:
                pc.append(t)
            seq += op[2]
            assert nc.ids == pc.ids == seq and list(nc.matched) == pc.matched
        elif op[0] == "remove":
            if held:
                gone = held.pop(op[1] % len(held))
                py.remove(gone)
                nat.remove(gone)
                cursors = {k: v for k, v in cursors.items() if v[2] is not gone}
                assert nat.version == py.version
        elif op[0] == "match":
            pm, nm, history = matchers[op[1]]
            del history[len(history) - min(op[2], len(history)) :]
            history += [max(t, 0) for t in op[3]] if op[4] else op[3]
            assert list(nm.peek(history)) == pm.peek(history)
            pn, nn = pm.matched(history), nm.matched(history)
            assert list(nn) == pn and list(nm._nodes) == pm._nodes
            same_draft(py, nat, pn, nn, op[5])
        elif op[0] == "draft":
            assert list(nat.matches(op[1])) == py.matches(op[1])
            num, factor, min_prob, _ = op[2]
            assert nat.speculate(op[1], num, factor, min_prob) == py.speculate(op[1], num, factor, min_prob)
            same_draft(py, nat, py.matches(op[1]), nat.matches(op[1]), op[2])
        else:  # "big": both refuse it and leave the tree as it was
            if op[1] not in cursors:
                continue
            pc, nc, seq = cursors[op[1]]
            for c in (pc, nc):
                with pytest.raises(ValueError, match="above the suffix tree's largest"):
                    c.append(MAX_TOKEN_ID + 1 + op[1])
            assert nc.ids == pc.ids == seq
        same_trees(py, nat)
        for pc, nc, _ in cursors.values():
            assert list(nc.matched) == pc.matched
            same_draft(py, nat, pc.matched, nc.matched, (4, 1.0, 0.0, None))
        for seq in held:
            assert list(nat.matches(seq)) == py.matches(seq)


def test_extend_is_append_one_at_a_time_and_stops_at_a_refused_id() -> None:
    ids = [5, 6, 5, -1, 5, 6, 7, MAX_TOKEN_ID, 5, 6]
    one, bulk = NativeSuffixTree(4), NativeSuffixTree(4)
    c1, c2 = one.cursor(), bulk.cursor()
    for t in ids:
        c1.append(t)
    c2.extend(ids)
    assert c1.ids == c2.ids == ids and c1.matched == c2.matched
    reference = SuffixTree(4)
    ref_cursor = reference.cursor()
    ref_cursor.extend(ids)
    same_trees(reference, bulk)
    with pytest.raises(ValueError, match=f"token id {MAX_TOKEN_ID + 1} is above"):
        c2.extend([1, 2, MAX_TOKEN_ID + 1, 3])
    assert c2.ids == [*ids, 1, 2]  # the ids before the refused one went in, it and the rest did not
    with pytest.raises(ValueError, match="token id 18446744073709551616 is above"):
        c2.extend([4, 1 << 64])  # beyond int64: one at a time, the same error
    assert c2.ids == [*ids, 1, 2, 4]
    ref_cursor.extend([1, 2, 4])
    assert list(c2.matched) == ref_cursor.matched
    same_trees(reference, bulk)
    reference.remove(c2.ids)
    bulk.remove(c2.ids)
    same_trees(reference, bulk)
    assert bulk.nodes == 1


def test_nodes_with_many_children_then_few_again() -> None:
    """A node's children move into the native tree's hash map past 8 and out again at 4 (a lookup either way)."""
    py, nat = SuffixTree(3), NativeSuffixTree(3)
    runs = [[7, t, 7, t + 1] for t in range(20)]  # the root and 7 get up to 21 children
    for run in runs:
        py.add(run)
        nat.add(run)
        same_trees(py, nat)
    for run in reversed(runs[3:]):
        py.remove(run)
        nat.remove(run)
        same_trees(py, nat)
        assert list(nat.matches([7, 3])) == py.matches([7, 3]) and nat.child(ROOT, 7) == py.child(ROOT, 7)
    for run in runs[3:]:
        py.add(run)
        nat.add(run)
    same_trees(py, nat)
    for t in range(25):
        assert nat.speculate([7, t], 3, 2.0, 0.0) == py.speculate([7, t], 3, 2.0, 0.0)


def test_bad_arguments_are_refused_like_the_python_tree() -> None:
    with pytest.raises(ValueError, match="max_depth must be >= 2, got 1"):
        NativeSuffixTree(1)
    tree = NativeSuffixTree(4)
    tree.add([1, 2, 3])
    assert tree.child(ROOT, -1) == tree.child(ROOT, MAX_TOKEN_ID + 1) == tree.child(-3, 1) == -1
    assert tree.matches([1 << 70, 1, 2]) == tree.matches([1, 2])
    with pytest.raises(ValueError, match="never added"):
        tree.remove([3, 2])
    with pytest.raises(ValueError, match="not in the tree"):
        native_best_draft(tree, [10_000], 2, 1.0, 0.0)
    with pytest.raises(IndexError):
        tree.children(1 << 40)
    for copy_of in (copy.copy, copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match="cannot be copied or pickled"):
            copy_of(tree)  # a copy would free the same native memory twice


def req(rid: str, prompt: list[int]) -> ExecutorRequest:
    return ExecutorRequest(rid, list(prompt), SamplingParams(temperature=0.0, max_tokens=64))


def window(r: ExecutorRequest, history: list[int], slots: int) -> Window:
    return Window(None, list(history), slots, Row(r.params, 0, request=r))  # type: ignore[arg-type]


small = st.lists(st.integers(0, 4), min_size=1, max_size=6)
proposer_ops = st.lists(
    st.one_of(
        st.tuples(st.just("grow"), st.integers(0, 2), small),
        st.tuples(st.just("rollback"), st.integers(0, 2), st.integers(1, 5), st.lists(st.integers(0, 4), max_size=3)),
        st.tuples(
            st.just("propose"), st.lists(st.integers(0, 2), min_size=1, max_size=3, unique=True), st.integers(0, 5)
        ),
        st.tuples(st.just("available"), st.integers(0, 2), st.integers(0, 5)),
        # the request leaves; the next in its slot is a new one, or the conversation's next turn
        st.tuples(st.just("release"), st.integers(0, 2), st.booleans(), small),
        st.tuples(
            st.just("forget"),
        ),
    ),
    max_size=40,
)


@settings(max_examples=120, deadline=None, database=None)
@given(
    ops=proposer_ops,
    depth=st.integers(2, 8),
    cached=st.sampled_from([0, 1, 2, 100]),
    factor=st.sampled_from([1.0, 2.0]),
    min_prob=st.sampled_from([0.0, 0.1, 0.4]),
)
def test_a_native_proposer_drafts_what_a_python_one_drafts(
    ops: list[tuple[Any, ...]], depth: int, cached: int, factor: float, min_prob: float
) -> None:
    options = dict(max_tree_depth=depth, max_cached_requests=cached, max_spec_factor=factor, min_token_prob=min_prob)
    py, nat = proposer("python", **options), proposer("native", **options)
    serial = 3
    running = [req(f"r{i}", [i, 1, 2, 1]) for i in range(3)]
    histories = [list(r.prompt_ids) for r in running]
    for op in ops:
        if op[0] == "grow":
            histories[op[1]] += op[2]
        elif op[0] == "rollback":
            h = histories[op[1]]
            keep = max(running[op[1]].prompt_len, len(h) - op[2])
            histories[op[1]] = h[:keep] + op[3]
        elif op[0] == "propose":
            windows = [window(running[i], histories[i], op[2]) for i in op[1]]
            assert nat.propose(windows) == py.propose(windows)
            for i in op[1]:
                got, want = nat.score(running[i], histories[i], op[2]), py.score(running[i], histories[i], op[2])
                assert got == want and got.score.hex() == float(want.score).hex()
        elif op[0] == "available":
            r, h = running[op[1]], histories[op[1]]
            assert nat.available(r, h, op[2]) == py.available(r, h, op[2])
        elif op[0] == "release":
            r, h = running[op[1]], histories[op[1]]
            output = h[r.prompt_len :]
            py.release(r, output)
            nat.release(r, output)
            prompt = [*h, *op[3]] if op[2] else list(op[3])
            running[op[1]], histories[op[1]] = req(f"r{serial}", prompt), list(prompt)
            serial += 1
        else:
            if not py._local:
                py.forget_finished()
                nat.forget_finished()
        assert nat.cached_requests == py.cached_requests and nat.global_tree.nodes == py.global_tree.nodes
    same_trees(py.global_tree, nat.global_tree)  # type: ignore[arg-type]


# MECHSERVE_SUFFIX_TREE and the native memory --------------------------------------------------------------------------


@pytest.fixture
def fresh_verdict() -> Iterator[None]:
    """``suffix_native``'s library and ``auto``'s verdict forgotten before and after the test."""
    suffix_native.forget()
    yield
    suffix_native.forget()


def test_a_bad_mode_is_refused_naming_the_variable(monkeypatch: pytest.MonkeyPatch, fresh_verdict: None) -> None:
    monkeypatch.setenv("MECHSERVE_SUFFIX_TREE", "rust")
    with pytest.raises(ValueError, match="MECHSERVE_SUFFIX_TREE must be one of auto, native, python, got 'rust'"):
        SuffixProposer()
    monkeypatch.setenv("MECHSERVE_SUFFIX_TREE", " Python ")
    assert not SuffixProposer().native


def test_without_a_compiler_native_is_an_error_and_auto_falls_back_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, capsys: pytest.CaptureFixture[str], fresh_verdict: None
) -> None:
    monkeypatch.setenv("MECHSERVE_CACHE", str(tmp_path))  # nothing built there
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setenv("MECHSERVE_SUFFIX_TREE", "native")
    # the error names what could not be built and the setting that asked for it (a fresh user's finding)
    with pytest.raises(
        NativeKernelError,
        match=r"^native suffix tree unavailable \(MECHSERVE_SUFFIX_TREE=native\): .*does not name an executable",
    ):
        SuffixProposer()
    monkeypatch.setenv("MECHSERVE_SUFFIX_TREE", "auto")
    capsys.readouterr()
    first, second = SuffixProposer(), SuffixProposer()
    assert not first.native and not second.native and isinstance(first.global_tree, SuffixTree)
    said = capsys.readouterr().err.splitlines()
    assert len(said) == 1 and "native suffix tree unavailable, using the Python suffix tree" in said[0]
    assert "does not name an executable" in said[0]
    monkeypatch.delenv("MECHSERVE_SUFFIX_TREE")  # unset is auto
    assert not SuffixProposer().native and capsys.readouterr().err == ""


def test_auto_is_native_where_it_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MECHSERVE_SUFFIX_TREE", raising=False)
    assert SuffixProposer().native and isinstance(SuffixProposer().global_tree, NativeSuffixTree)


def test_native_memory_is_given_back_with_the_tree() -> None:
    live = suffix_native.library().mechserve_suffix_tree_live
    gc.collect()
    before = live()
    trees = [NativeSuffixTree(8) for _ in range(5)]
    for t in trees:
        t.add(list(range(100)))
    assert live() == before + 5
    del trees, t
    assert live() == before  # freed as the objects go (reference counting; no collection needed)
    p = proposer("native", max_tree_depth=6, max_cached_requests=4)
    r = req("a", [1, 2, 3])
    p.propose([window(r, [1, 2, 3, 4, 5], 2)])
    p.release(r, [4, 5])
    old = weakref.ref(p.global_tree)
    held = live()
    p.forget_finished()  # the old global tree and the kept request tree go, a new global tree comes
    assert old() is None and live() == held - 1
    del p
    assert live() == before


def _state(tree: NativeSuffixTree, tokens: range) -> tuple[Any, ...]:
    """What a tree answers: its nodes, every node's children and fields, and a long draft from the root."""
    nodes = [(n, tree.children(n), tree.count[n], tree.out[n], tree.best[n]) for n in range(tree._top)]
    root_draft = native_best_draft(tree, [ROOT], 1000, 1000.0, 0.0)
    return tree.nodes, nodes, root_draft, [tree.matches([t]).tolist() for t in tokens]


def test_a_refused_remove_changes_nothing() -> None:
    """Ids never added (or added fewer times than removed) are refused before any count moves: a half-made
    remove left chains below a node longer than ``max_depth``, and a draft then wrote past its buffers (found
    by review: this sequence, the refused removes ignored, drafted 5 ids with room for 3)."""
    tree = NativeSuffixTree(3)
    ops: list[tuple[str, list[int]]] = [
        ("remove", [1, 1, 1]), ("add", [1, 0]), ("add", [2, 0]), ("remove", [2]), ("remove", [2]),
        ("add", [1, 2, 2, 1]), ("add", [2, 3, 2, 0]), ("remove", [3, 1, 3]), ("add", [1, 2, 1, 1]),
    ]  # fmt: skip
    python = SuffixTree(3)
    for op, ids in ops:
        if op == "add":
            tree.add(ids)
            python.add(ids)
            continue
        before = _state(tree, range(5))
        try:
            tree.remove(ids)
        except ValueError:
            assert _state(tree, range(5)) == before
        else:
            python.remove(ids)
    # every remove refused left it as the Python tree that never saw them
    assert native_best_draft(tree, [ROOT], 1000, 1000.0, 0.0) == best_draft(python, [ROOT], 1000, 1000.0, 0.0)
    assert tree.nodes == python.nodes
    for node in range(1, 20):  # no draft from any node runs past max_depth ids
        found = native_best_draft(tree, [node], 1000, 1000.0, 0.0) if node < tree._top else Match()
        assert len(found.ids) <= tree.max_depth


def test_a_tree_that_ran_out_of_memory_refuses_every_later_call_without_crashing() -> None:
    """The allocation of a node block fails (the address space limited in a child process): the append that
    ran out raises ``MemoryError``, and so does every later change, with memory back; questions answer
    nothing.  Before, the node counter had moved past the storage, and the next append wrote outside it."""
    code = """
import resource
from mechserve.executor.proposers_suffix import NativeSuffixTree
tree = NativeSuffixTree(2)
cursor = tree.cursor()
cursor.extend(range(32768))  # the first block full
soft, hard = resource.getrlimit(resource.RLIMIT_AS)
size = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (size + (1 << 20), hard))
try:
    cursor.append(40000)
except MemoryError as e:
    first = str(e)
else:
    raise SystemExit("no MemoryError with the address space limited")
resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
for change in (lambda: cursor.append(40001), lambda: cursor.extend([1, 2]), lambda: tree.remove([5])):
    try:
        change()
    except MemoryError:
        pass
    else:
        raise SystemExit("a change of a tree that ran out was not refused")
assert len(tree.matches([1])) == 0 and tree.child(0, 1) == -1 and tree.speculate([1], 4, 1.0, 0.0).ids == ()
print("ok", first)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("ok no memory for the native suffix tree"), done.stdout


def test_depths_past_the_native_bound_and_odd_ids_are_refused_or_missed() -> None:
    for depth in (NATIVE_MAX_DEPTH + 1, 1 << 60, 1 << 64):
        with pytest.raises(ValueError, match=f"max_depth must be <= {NATIVE_MAX_DEPTH}"):
            NativeSuffixTree(depth)
    tree = NativeSuffixTree(4)
    tree.add([1, 2, 3])
    matcher = NativeMatcher(tree)
    assert list(matcher.matched([1, 2])) == list(tree.matches([1, 2]))
    assert list(matcher.matched([1, 2, -(1 << 64)])) == []  # an unknown id beyond int64 breaks the sequence
    assert list(matcher.matched([1, 2, -(1 << 64), 1 << 40])) == []  # one past the tree's ids: a miss
