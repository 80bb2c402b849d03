"""Pins every numbered line of mech-notes/06-prefix-hash.md."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from mechserve.spec import m05_preemption as m05
from mechserve.spec import m06_prefix_hash as m


def test_m06_n1_a_key_is_namespace_parent_and_block_tokens() -> None:
    k0, k1 = m.prefix_keys([1, 2, 3, 4], 2)
    assert m.ROOT is None
    assert (k0.namespace, k0.parent, k0.block_tokens) == ("engine", None, (1, 2))
    assert (k1.namespace, k1.parent, k1.block_tokens) == ("engine", k0, (3, 4))
    assert isinstance(k0.block_tokens, tuple)
    with pytest.raises(dataclasses.FrozenInstanceError):
        k0.block_tokens = (9, 9)  # type: ignore[misc]


@pytest.mark.parametrize(
    ("tokens", "page_size", "blocks"),
    [
        ([1, 2, 3, 4, 5], 2, [(1, 2), (3, 4)]),
        ([1, 2, 3, 4], 2, [(1, 2), (3, 4)]),
        ([1, 2, 3], 4, []),
        ([7], 1, [(7,)]),
        ([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, [(1, 2, 3, 4), (5, 6, 7, 8)]),
    ],
)
def test_m06_n2_one_key_per_complete_block_and_none_for_the_partial_tail(
    tokens: list[int], page_size: int, blocks: list[tuple[int, ...]]
) -> None:
    keys = m.prefix_keys(tokens, page_size)
    assert len(keys) == len(tokens) // page_size
    assert [k.block_tokens for k in keys] == blocks


def test_m06_n3_keys_chain_from_root() -> None:
    keys = m.prefix_keys(list(range(12)), 3)
    assert len(keys) == 4
    assert keys[0].parent is m.ROOT
    for prev, key in itertools.pairwise(keys):
        assert key.parent is prev


def test_m06_n4_equal_prefixes_give_equal_chains_wherever_they_live() -> None:
    a = m.prefix_keys([1, 2, 3, 4, 5, 6, 9], 2)
    b = m.prefix_keys([1, 2, 3, 4, 5, 6, 7, 8], 2)
    # built independently, so equality cannot be identity
    assert a[0] is not b[0]
    assert a == b[:3]
    assert [hash(k) for k in a] == [hash(k) for k in b[:3]]
    assert {a[2]: "page 5"}[b[2]] == "page 5"
    assert a[2] != b[3]


def test_m06_n5_a_different_first_block_gives_disjoint_chains() -> None:
    a = m.prefix_keys([1, 2, 5, 6, 7, 8], 2)
    b = m.prefix_keys([9, 9, 5, 6, 7, 8], 2)
    assert [k.block_tokens for k in a[1:]] == [k.block_tokens for k in b[1:]]
    assert not set(a) & set(b)
    # a difference in a middle block also separates everything from there on
    c = m.prefix_keys([1, 2, 0, 0, 7, 8], 2)
    assert c[0] == a[0]
    assert c[1] != a[1] and c[2] != a[2]


def test_m06_n6_the_namespace_is_part_of_the_key() -> None:
    tokens = [1, 2, 3, 4]
    default = m.prefix_keys(tokens, 2)
    assert all(k.namespace == "engine" for k in default)
    assert default == m.prefix_keys(tokens, 2, "engine")
    other = m.prefix_keys(tokens, 2, "adapter-7")
    assert all(k.namespace == "adapter-7" for k in other)
    assert default[0] != other[0] and default[1] != other[1]
    assert not set(default) & set(other)


def _run(mod, spec: dict) -> tuple[list[dict], list[dict], str | None]:
    reqs = [mod.Request(**r) for r in spec["requests"]]
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


def _named(spec: dict) -> dict:
    return {**spec, "requests": [{"request_id": f"r{i}", **r} for i, r in enumerate(spec["requests"])]}


@settings(max_examples=60, deadline=None)
@example(_ANCHOR)
@given(_workload)
def test_m06_n7_the_engine_is_m05s_engine(spec: dict) -> None:
    spec = _named(spec)
    assert _run(m, spec) == _run(m05, spec)
