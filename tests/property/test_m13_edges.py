"""The top rung's edges that mutation testing found untested (docs/mutation.md): the engine's own refusals,
an object offered twice, ``abort`` of an unknown id, ``drop_finished``, and a hold on a one-block prompt."""

from __future__ import annotations

import pytest

from mechserve.spec import m13_output_caching as m

R = m.Request


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"max_step_tokens": 0}, "max_step_tokens must be > 0"),
        ({"world_size": 0}, "world_size must be > 0"),
        ({"max_waiting": 0}, "max_waiting must be > 0"),
        ({"max_running": 0}, "max_running must be > 0"),
        ({"max_model_len": 0}, "max_model_len must be > 0"),
    ],
)
def test_a_setting_out_of_range_is_refused_by_name(setting: dict[str, int], message: str) -> None:
    kwargs = {"max_step_tokens": 4, "page_size": 2, "num_pages": 8} | setting
    with pytest.raises(ValueError, match=f"^{message}$"):
        m.Engine([], **kwargs)


def test_a_request_object_with_output_already_is_not_offered_again() -> None:
    eng = m.Engine([], 4, 2, 8)
    used = R("a", [1, 2, 3], 2)
    used.output_ids = [5]  # still WAITING, but it has run before
    with pytest.raises(ValueError, match="offered before"):
        eng.add_request(used)


def test_abort_of_an_unknown_or_finished_request_is_false() -> None:
    eng = m.Engine([R("a", [1, 2, 3], 1)], 4, 2, 8)
    assert eng.abort("nobody") is False
    eng.run()
    assert eng.abort("a") is False
    assert [r.state for r in eng.requests] == [m.RequestState.FINISHED]


def test_drop_finished_lets_go_once_the_leaving_is_recorded() -> None:
    eng = m.Engine([R("a", [1, 2, 3], 1), R("b", [1, 2, 3, 4, 5, 6, 7], 8)], 4, 2, 8)
    assert eng.drop_finished() == []
    eng.step()
    eng.step()
    assert [r.request_id for r in eng.drop_finished()] == ["a"]
    assert [r.request_id for r in eng.requests] == ["b"]
    assert eng.abort("b") is True
    assert eng.drop_finished() == []  # the abort is recorded in the next step first
    assert eng.step().aborted == ("b",)
    assert [r.request_id for r in eng.drop_finished()] == ["b"] and eng.requests == []


def test_a_one_block_prompt_is_held_while_its_block_is_computed() -> None:
    # pages of 4, budget 3: p has computed positions 0..2 of block 0 when q, whose one usable block is p's
    # block 0, arrives; q waits for it instead of computing it again
    eng = m.Engine([R("p", [1, 2, 3, 4, 5, 6, 7, 8, 9], 1)], 3, 4, 16, hold_shared_prefix=True)
    eng.step()
    eng.add_request(R("q", [1, 2, 3, 4, 5], 1))
    t1 = eng.step()
    assert t1.admitted == () and any(line.startswith("q is held back: p") for line in t1.explain)
    t2 = eng.step()
    assert (t2.admitted, dict(t2.reused)) == (("q",), {"q": 4})
