"""Pins every numbered line of mech-notes/07-radix-cache.md."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from mechserve.spec import m05_preemption as m05
from mechserve.spec import m07_radix_cache as m

PS = 2


def keys(*tokens: int) -> list[m.PrefixKey]:
    return m.prefix_keys(list(tokens), PS)


def shape(children: dict) -> list:
    """The trie as nested ``(block, [children...])`` lists, in map order."""
    return [(node.block, shape(node.children)) for node in children.values()]


def tree() -> tuple[m.RadixCache, list[m.PrefixKey], list[m.PrefixKey]]:
    """root ─ k0:[10] ─┬─ k1:[11] ─ k2:[12]   (k: blocks 1 2 | 3 4 | 5 6)
    └─ j1:[15]              (j: blocks 1 2 | 7 7)
    """
    cache = m.RadixCache()
    k = keys(1, 2, 3, 4, 5, 6)
    j = keys(1, 2, 7, 7)
    assert cache.insert(k, [10, 11, 12]) == 3
    assert cache.insert(j, [10, 15]) == 1
    return cache, k, j


def test_m07_n1_a_new_cache_is_empty() -> None:
    cache = m.RadixCache()
    assert cache.size == 0
    assert cache.root == {}
    assert cache.match(keys(1, 2, 3, 4)) == []
    assert cache.match([]) == []


def test_m07_n2_insert_creates_only_missing_nodes_and_counts_them() -> None:
    cache = m.RadixCache()
    k = keys(1, 2, 3, 4, 5, 6)
    assert cache.insert(k[:1], [10]) == 1
    assert cache.size == 1
    assert cache.insert(k, [10, 11, 12]) == 2
    assert cache.size == 3
    assert cache.insert(k, [10, 11, 12]) == 0
    assert cache.size == 3
    assert cache.insert([], []) == 0
    assert shape(cache.root) == [(10, [(11, [(12, [])])])]


def test_m07_n3_insert_rejects_length_mismatch() -> None:
    cache, _, _ = tree()
    before = shape(cache.root)
    with pytest.raises(ValueError):
        cache.insert(keys(9, 9, 8, 8), [20])
    with pytest.raises(ValueError):
        cache.insert(keys(9, 9), [20, 21])
    assert shape(cache.root) == before
    assert cache.size == 4


def test_m07_n4_insert_rejects_keys_that_are_not_a_chain_from_root() -> None:
    cache = m.RadixCache()
    k = keys(1, 2, 3, 4, 5, 6)
    with pytest.raises(ValueError):
        cache.insert(k[1:], [11, 12])  # key 0's parent is not ROOT
    with pytest.raises(ValueError):
        cache.insert([k[0], k[2]], [10, 12])  # a gap in the chain
    with pytest.raises(ValueError):
        cache.insert([k[0], keys(9, 9, 3, 4)[1]], [10, 11])  # parent is another chain's key
    assert cache.size == 0
    assert cache.root == {}


def test_m07_n5_insert_rejects_a_different_block_for_a_resident_key() -> None:
    cache, k, _ = tree()
    with pytest.raises(ValueError):
        cache.insert(k[:2], [10, 99])
    with pytest.raises(ValueError):
        cache.insert(k, [77, 11, 12])
    assert cache.match(k) == [10, 11, 12]
    assert cache.size == 4


def test_m07_n6_match_returns_the_longest_leading_run_and_stops_at_the_first_miss() -> None:
    cache, k, j = tree()
    assert cache.match(k) == [10, 11, 12]
    assert cache.match(j) == [10, 15]
    assert cache.match(keys(1, 2, 3, 4, 5, 6, 7, 8)) == [10, 11, 12]
    assert cache.match(keys(1, 2, 3, 4, 9, 9)) == [10, 11]
    # a resident root key after a miss is not found: the walk stopped
    assert cache.match([keys(8, 8)[0], k[0]]) == []

    class Untouchable:
        def __hash__(self) -> int:
            raise AssertionError("examined a key after the first miss")

    assert cache.match([k[0], keys(1, 2, 9, 9)[1], Untouchable()]) == [10]  # type: ignore[list-item]


def test_m07_n7_children_keep_insertion_order_and_reinsertion_goes_last() -> None:
    cache = m.RadixCache()
    a, b, c = keys(1, 2, 3, 3), keys(1, 2, 4, 4), keys(1, 2, 5, 5)
    cache.insert(a, [0, 1])
    cache.insert(b, [0, 2])
    cache.insert(c, [0, 3])
    cache.insert(keys(6, 6), [4])
    assert shape(cache.root) == [(0, [(1, []), (2, []), (3, [])]), (4, [])]
    assert cache.remove_leaf(a[1]) == 1
    assert cache.insert(a, [0, 1]) == 1
    assert shape(cache.root) == [(0, [(2, []), (3, []), (1, [])]), (4, [])]


def test_m07_n8_remove_leaf_deletes_a_childless_node_and_returns_its_block() -> None:
    cache, k, j = tree()
    assert cache.remove_leaf(k[2]) == 12
    assert cache.size == 3
    assert cache.match(k) == [10, 11]
    assert cache.remove_leaf(k[1]) == 11  # became a leaf once k2 was gone
    assert cache.size == 2
    assert shape(cache.root) == [(10, [(15, [])])]
    assert cache.remove_leaf(j[1]) == 15
    assert cache.remove_leaf(k[0]) == 10
    assert cache.size == 0
    assert cache.root == {}


def test_m07_n9_remove_leaf_refuses_inner_nodes() -> None:
    cache, k, _ = tree()
    before = shape(cache.root)
    with pytest.raises(ValueError):
        cache.remove_leaf(k[0])
    with pytest.raises(ValueError):
        cache.remove_leaf(k[1])
    with pytest.raises(ValueError):
        cache.remove_leaf(keys(1, 2, 9, 9)[1])  # not cached
    assert shape(cache.root) == before
    assert cache.size == 4


def _run(mod, spec: dict) -> tuple[list[dict], list[dict], str | None]:
    reqs = [mod.Request(f"r{i}", **r) for i, r in enumerate(spec["requests"])]
    eng = mod.Engine(reqs, spec["max_step_tokens"], spec["page_size"], spec["num_pages"])
    trace: list[dict] = []
    try:
        while any(r.state is not mod.RequestState.FINISHED for r in eng.requests) and len(trace) < 500:
            trace.append(eng.step().to_json())
    except Exception as exc:
        return trace, eng.summary(), f"{type(exc).__name__}@{eng.step_counter}"
    return trace, eng.summary(), None


_request = st.fixed_dictionaries(
    {"prompt_len": st.integers(1, 9), "max_new_tokens": st.integers(1, 5)},
    optional={"arrival_step": st.integers(0, 3), "eos_after": st.integers(0, 4)},
)
_workload = st.fixed_dictionaries(
    {
        "max_step_tokens": st.integers(1, 10),
        "page_size": st.integers(1, 4),
        "num_pages": st.integers(1, 8),
        "requests": st.lists(_request, max_size=4),
    }
)
# 02-preemption-anchor's workload: preemption, pageless victims, recompute.
_ANCHOR = {
    "max_step_tokens": 8,
    "page_size": 2,
    "num_pages": 6,
    "requests": [
        {"prompt_len": 3, "max_new_tokens": 6},
        {"prompt_len": 3, "max_new_tokens": 5},
        {"prompt_len": 4, "max_new_tokens": 3, "arrival_step": 1},
    ],
}


@settings(max_examples=60, deadline=None)
@example(_ANCHOR)
@given(_workload)
def test_m07_n10_the_engine_is_m05s_engine(spec: dict) -> None:
    assert _run(m, spec) == _run(m05, spec)
