"""The EAGLE head (``--spec-method eagle``, issue 27 item 2) on tiny random models, with heads trained in seconds.

The target forward's hidden states (``hidden_out``) are transformers' final hidden states; the proposer keeps
exactly the target's features of the rows each request kept; greedy output equals decoding without
speculation alone, batched, chunked, preempted and with the adaptive governor; seeded sampling's ids do not
change and unseeded sampling's distribution is the target's (chi-square); a head of another model or shape is
refused naming both, none trained says to run ``train-draft``; the head's files round-trip; ``train-draft``'s
CLI trains, writes and refuses bad flags with one line.  Elsewhere: exactness with structured outputs in
structured/test_constrained_engine.py; with penalties, logit bias and bad words (batched, preempted, and with
the prefix and output caches over a second turn) in engine/test_penalties_engine.py; stop ids, EOS and stop
strings inside accepted runs in test_spec_decode.py (BC16/BC22); every way a head can be missing or wrong, on
every path that loads one, in cli/test_eagle_head_errors.py.  The heads are trained by
``tiny_engines.train_tiny_head`` on the model's own outputs.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_checkpoints import Tiny, build_tiny, random_prompts
from tiny_engines import (
    HEAD_PROMPTS,
    answer,
    core,
    drafted_and_accepted,
    eagle_spec,
    greedy_sequences,
    train_tiny_head,
)
from tiny_models import VOCAB, save_word_tokenizer

from executor.test_spec_decode import PROMPTS, run, total
from executor.test_spec_sampling import PARAMS, PROMPT, SMALL_V, chi_square_p, small_model, target_joint
from mechserve.api.config import SpeculativeConfig
from mechserve.api.params import SamplingParams
from mechserve.cli.main import main
from mechserve.engine.core import EngineCore
from mechserve.executor.proposers_eagle import EagleProposer
from mechserve.executor.request import ExecutorRequest
from mechserve.executor.sampling import Sampler
from mechserve.executor.torch_executor import TorchExecutor
from mechserve.model import eagle
from mechserve.model.eagle import EagleHead, HeadConfig, HeadError, Shared
from mechserve.model.eagle_train import TrainSettings, evaluate, record, train_head
from mechserve.model.loader import LoadedModel
from mechserve.spec import m16_request_draft_lengths as m16


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def head(tiny: Tiny, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A head trained on the model's greedy continuations of the prompts the tests decode (and more): a random
    model's text has nothing to generalise from, and guesses must be accepted for verification to be tested."""
    sequences = greedy_sequences(tiny.model, [*HEAD_PROMPTS, *PROMPTS], 24)
    return train_tiny_head(tiny.model, tmp_path_factory.mktemp("eagle-head"), sequences, steps=120)


@pytest.fixture(scope="module")
def plain(tiny: Tiny) -> dict[str, list[int]]:
    return run(tiny.model, PROMPTS, 16).outputs


def test_the_forward_returns_transformers_final_hidden_states(tiny: Tiny) -> None:
    ids = random_prompts([13], seed=5)[0]
    got = record(tiny.model, ids, 3)
    with torch.no_grad():
        hf = tiny.hf(torch.tensor([ids]), output_hidden_states=True)
    torch.testing.assert_close(got.feats, hf.hidden_states[-1][0, 3:].float(), atol=2e-4, rtol=1e-4)
    assert got.labels.tolist() == hf.logits[0, 3:].argmax(-1).tolist()


@pytest.mark.parametrize(
    "shape",
    [
        dict(budget=64, page_size=4),
        dict(budget=7, page_size=2, arrivals=[0, 0, 1, 1, 2, 3, 3, 5]),
        dict(budget=20, page_size=1, num_pages=400),
    ],
    ids=["batch-8", "chunked-staggered", "page-size-1"],
)
def test_greedy_output_equals_plain_decoding(
    tiny: Tiny, head: Path, plain: dict[str, list[int]], shape: dict[str, Any]
) -> None:
    got = run(tiny.model, PROMPTS, 16, spec=eagle_spec(head), **shape)
    assert got.outputs == plain
    assert total(got.records, "drafted") > 0 and got.executor.stats().accepted > 0


def test_batch_one_equals_plain_decoding(tiny: Tiny, head: Path, plain: dict[str, list[int]]) -> None:
    for i, p in enumerate(PROMPTS):
        assert run(tiny.model, [p], 16, spec=eagle_spec(head, 4)).outputs["r0"] == plain[f"r{i}"]


def test_preemption_mid_speculation_gives_the_same_output(tiny: Tiny, head: Path, plain: dict[str, list[int]]) -> None:
    need = max(m16.pages_for(len(p) + 16, 2) for p in PROMPTS)
    got = run(tiny.model, PROMPTS, 16, spec=eagle_spec(head), page_size=2, num_pages=need + 6, budget=24)
    assert got.outputs == plain
    assert any(rec.preempted for rec in got.records)
    assert total(got.records, "rolled_back") > 0 and total(got.records, "accepted") > 0


def test_the_proposer_keeps_the_targets_features_of_the_kept_rows(tiny: Tiny, head: Path) -> None:
    """After every step, each feature the proposer holds is the one a teacher-forced forward over the request's
    final ids gives at that position, and it is paired with the id there."""
    checked = 0

    def on_step(engine: Any, ex: TorchExecutor, record_: m16.StepRecord) -> None:
        nonlocal checked
        proposer = ex.proposer
        assert isinstance(proposer, EagleProposer)
        for rid, state in proposer._features.items():
            ids = [t for t in ex.history(rid)]
            if min(ids, default=0) < 0:
                continue
            reference = record(tiny.model, ids, 0)
            for p, (t, f) in state.rows.items():
                if p < len(ids) - 1:  # the last one may sit past a cut the control side made
                    assert t == ids[p]
                    torch.testing.assert_close(f, reference.feats[p], atol=2e-4, rtol=1e-4)
                    checked += 1

    got = run(tiny.model, PROMPTS[:4], 16, spec=eagle_spec(head), budget=64, page_size=4, on_step=on_step)
    assert checked > 20 and total(got.records, "accepted") > 0


@pytest.mark.parametrize("sat_out", [1, 3, 9])
def test_a_request_that_sat_out_drafts_from_the_features_it_would_have_kept(
    tiny: Tiny, head: Path, plain: dict[str, list[int]], sat_out: int
) -> None:
    from dataclasses import replace

    """Windows of spec_len 0 (the governor sat the requests out) do not read the features, but each step's row
    is still kept: the first windows that draft again guess exactly what a proposer fed the teacher-forced
    features of every position guesses, and the output does not change."""
    resumed: list[tuple[tuple[int, ...], Any]] = []
    steps = 0

    def on_step(engine_: Any, ex: TorchExecutor, record_: m16.StepRecord) -> None:
        nonlocal steps
        steps += 1  # step 1 is the prompts' prefill; the next ``sat_out`` steps decode with spec_len 0
        engine_.spec_len = 0 if steps <= sat_out else 3

    real_propose = EagleProposer.propose

    def spy(self: EagleProposer, windows: Any) -> Any:
        drafts = real_propose(self, windows)
        if not resumed and any(w.slots > 0 for w in windows):
            # (the window's history as it was: the executor's list grows as the request does)
            resumed.extend((d.tokens, replace(w, history=list(w.history))) for w, d in zip(windows, drafts) if w.slots)
        return drafts

    real_context = EagleProposer._context

    def read(self: EagleProposer, w: Any) -> list[int]:
        assert w.slots > 0, "a window that was sat out read the features"
        return real_context(self, w)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(EagleProposer, "propose", spy)
        mp.setattr(EagleProposer, "_context", read)
        got = run(tiny.model, PROMPTS, 16, spec=eagle_spec(head), budget=256, num_pages=200, on_step=on_step)
    assert got.outputs == plain
    assert len(resumed) == len(PROMPTS) and all(tokens for tokens, _ in resumed)
    assert min(len(w.history) for _, w in resumed) > min(len(p) for p in PROMPTS) + sat_out - 1
    kept_along = EagleProposer(tiny.model, eagle.load(head, tiny.model))
    for tokens, w in resumed:
        # the target's features, teacher-forced, at every position the target computed a sampling row for: from
        # the prompt's last (its prefill's row) on
        first = w.request.prompt_len - 1
        kept_along.observe(w.request, first, w.history[first:], record(tiny.model, w.history, first).feats)
        assert kept_along.propose([w])[0].tokens == tokens


def engine(tiny: Tiny, spec: SpeculativeConfig | None) -> EngineCore:
    loaded = LoadedModel(tiny.path, tiny.model, None, ())
    return core(loaded, num_pages=128, prefix_caching=True, output_caching=True, speculative=spec)


def test_adaptive_speculation_with_the_head_keeps_the_output(
    tiny: Tiny, head: Path, plain: dict[str, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The governor sizes each window (down to none) from the head's acceptance so far: the ids do not change.
    Its rounds priced free here (the static cost model without the head's price), so that windows are drafted
    whatever this machine's costs: what the measured price turns off is tested in ``test_spec_costs.py``."""
    from dataclasses import replace

    from mechserve.api.proposers import PROPOSERS

    monkeypatch.setenv("MECHSERVE_SPEC_COSTS", "static")
    monkeypatch.setitem(PROPOSERS, "eagle", replace(PROPOSERS["eagle"], governor=None))  # type: ignore[call-overload]
    adaptive = SpeculativeConfig(method="eagle", num_speculative_tokens=4, eagle_head=str(head))
    params = SamplingParams(temperature=0.0, max_tokens=16)
    got, records = answer(engine(tiny, adaptive), PROMPTS, params)
    assert got == [plain[f"r{i}"] for i in range(len(PROMPTS))]
    assert drafted_and_accepted(records)[1] > 0


def test_seeded_sampling_ids_do_not_change(tiny: Tiny, head: Path) -> None:
    """The head's guesses are point masses: a seeded request draws the ids it draws without speculation."""
    params = SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=16, ignore_eos=True)
    without = run(tiny.model, PROMPTS, 16, params=params).outputs
    with_head = run(tiny.model, PROMPTS, 16, params=params, spec=eagle_spec(head))
    assert with_head.outputs == without
    assert total(with_head.records, "accepted") > 0


def test_sampling_with_the_head_keeps_the_target_distribution(tmp_path: Path) -> None:
    """Unseeded sampling, 3000 requests of 4 tokens with windows of 2 guesses: the joint of the first three ids
    and the marginal of the fourth match the target's own distribution (chi-square), and guesses were both
    accepted and rejected."""
    model, hf = small_model(2, seed=0)
    prompts = [[i % SMALL_V, (i * 3) % SMALL_V, 1] for i in range(10)]
    directory = train_tiny_head(model, tmp_path, greedy_sequences(model, prompts, 24), steps=30)
    n = 3000
    spec = SpeculativeConfig(method="eagle", num_speculative_tokens=2, adaptive=False, eagle_head=str(directory))
    ex = TorchExecutor(model, n + 1, 8, sampler=Sampler(3), speculative=spec)
    requests = []
    for i in range(n):
        ex.add_request(ExecutorRequest(f"r{i}", PROMPT, PARAMS))
        requests.append(m16.Request(f"r{i}", list(PROMPT), PARAMS.max_tokens))
    m16.Engine(requests, 1 << 20, 8, n + 1, spec_len=2, executors=[ex], eos_token_ids=()).run(
        lambda rec: ex.settle(rec.accepted)
    )
    runs = [list(r.output_ids) for r in requests]
    joint = target_joint(hf, PARAMS, 4)
    first3: dict[object, float] = Counter()
    last: dict[object, float] = Counter()
    for seq, w in joint.items():
        first3[seq[:3]] += w
        last[seq[3]] += w
    assert chi_square_p(Counter(tuple(r[:3]) for r in runs), dict(first3)) > 1e-3
    assert chi_square_p(Counter(r[3] for r in runs), dict(last)) > 1e-3
    assert 0 < ex.stats().accepted < ex.stats().proposed


def test_a_head_of_another_model_is_refused_naming_both(
    tiny: Tiny, head: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    other = build_tiny(tmp_path_factory.mktemp("other-weights"), seed=3)
    with pytest.raises(HeadError) as err:
        TorchExecutor(other.model, 32, 4, speculative=eagle_spec(head))
    message = str(err.value)
    assert message.startswith(f"the EAGLE head trained for {tiny.path} does not match the loaded model {other.path}")
    assert f"the head is in {head}); train one for it with `mechserve train-draft --model {other.path}`" in message
    wider = build_tiny(tmp_path_factory.mktemp("other-shape"), hidden_size=32)
    with pytest.raises(HeadError) as err:
        TorchExecutor(wider.model, 32, 4, speculative=eagle_spec(head))
    assert str(err.value).startswith(
        f"the EAGLE head trained for {tiny.path} has another shape than the loaded model {wider.path} "
        "(hidden 64 vs 32, head_dim 16 vs 8"
    )


def test_the_head_lives_in_the_cache_under_the_fingerprint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MECHSERVE_CACHE", str(tmp_path))
    assert eagle.head_dir("ab" * 32) == tmp_path / "eagle" / ("ab" * 8)


def test_no_head_trained_says_to_run_train_draft(tiny: Tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the cache's head directory, moved here (MECHSERVE_CACHE would also move the built kernels)
    monkeypatch.setattr(eagle, "head_dir", lambda fingerprint: tmp_path / fingerprint[:16])
    spec = SpeculativeConfig(method="eagle", num_speculative_tokens=3)
    with pytest.raises(
        HeadError, match=r"no EAGLE head has been trained for the loaded model .*: run `mechserve train-draft"
    ):
        TorchExecutor(tiny.model, 32, 4, speculative=spec)
    # written where train-draft writes it, it is found
    eagle.save(
        eagle.head_dir(eagle.model_fingerprint(tiny.model)),
        EagleHead(HeadConfig.of(tiny.model)),
        torch.arange(VOCAB),
        tiny.model,
        eagle.model_fingerprint(tiny.model),
        {"seed": 1},
    )
    ex = TorchExecutor(tiny.model, 32, 4, speculative=spec)
    assert isinstance(ex.proposer, EagleProposer) and ex.proposer.loaded.config["seed"] == 1


def test_the_head_files_round_trip(tiny: Tiny, head: Path, tmp_path: Path) -> None:
    loaded = eagle.load(head, tiny.model)
    eagle.save(tmp_path, loaded.head, loaded.draft_vocab, tiny.model, eagle.model_fingerprint(tiny.model), {"x": 2})
    again = eagle.load(tmp_path, tiny.model)
    for (name, a), (_, b) in zip(loaded.head.state_dict().items(), again.head.state_dict().items()):
        assert torch.equal(a, b), name
    assert torch.equal(loaded.draft_vocab, again.draft_vocab) and sorted(again.draft_vocab.tolist()) == list(
        range(VOCAB)
    )
    assert again.config["shape"] == loaded.config["shape"] and again.config["x"] == 2
    assert again.config["target_fingerprint"] == eagle.model_fingerprint(tiny.model)
    (tmp_path / eagle.HEAD_FILE).write_bytes(b"not safetensors")
    with pytest.raises(HeadError, match="is unreadable"):
        eagle.load(tmp_path, tiny.model)


def test_training_lowers_the_loss_and_raises_the_acceptance(tiny: Tiny) -> None:
    """On the text it was trained on (a random model's text has nothing to generalise from), the head's loss
    falls and its chain acceptance rises well above an untrained head's."""
    prompts = random_prompts([6, 9, 4, 11, 7, 5, 8, 10], seed=99)
    outputs = run(tiny.model, prompts, 24).outputs
    data = [record(tiny.model, [*p, *outputs[f"r{i}"]], len(p) - 1) for i, p in enumerate(prompts)]
    settings = TrainSettings(window=4, spec_len=3, batch_size=8, steps=120, lr=3e-3)
    head = EagleHead(HeadConfig.of(tiny.model, 4))
    head.init_weights(0)
    untrained = evaluate(head, Shared(tiny.model), data, settings)
    curve = train_head(head, Shared(tiny.model), data, settings, math.inf, lambda line: None)
    trained = evaluate(head, Shared(tiny.model), data, settings)
    assert curve[-1][1] < curve[0][1] / 2 and curve[-1][0] == 120
    assert trained[0] > 0.5 > untrained[0] and eagle.expected_kept(trained) > eagle.expected_kept(untrained) + 0.5


def test_speculative_config_takes_eagle_options() -> None:
    spec = SpeculativeConfig.of({"method": "eagle", "model": "/heads/x", "num_speculative_tokens": 4})
    assert spec is not None and spec.eagle_head == "/heads/x" and spec.draft_model is None
    with pytest.raises(ValueError, match="eagle_draft_vocab must be an integer >= 0"):
        SpeculativeConfig(method="eagle", eagle_draft_vocab=-1)
    with pytest.raises(ValueError, match='eagle_head is an option of method "eagle", but method is "ngram"'):
        SpeculativeConfig(method="ngram", eagle_head="/x")


def test_fr_spec_vocabulary_drafts_only_frequent_ids(
    tiny: Tiny, head: Path, plain: dict[str, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``eagle_draft_vocab`` N: every guess is one of the N ids first in the head's frequency ranking."""
    drafted: list[torch.Tensor] = []
    original = EagleHead.draft

    def spy(self: EagleHead, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = original(self, *args, **kwargs)
        drafted.append(out)
        return out

    monkeypatch.setattr(EagleHead, "draft", spy)
    got = run(tiny.model, PROMPTS, 16, spec=eagle_spec(head, eagle_draft_vocab=8))
    assert got.outputs == plain
    allowed = set(eagle.load(head, tiny.model).draft_vocab[:8].tolist())
    guesses = set(torch.cat([d.reshape(-1) for d in drafted]).tolist())
    assert drafted and guesses <= allowed


def cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-tok")
    build_tiny(path)
    save_word_tokenizer(path)
    return path


def test_train_draft_trains_writes_and_generate_uses_the_head(
    tiny_with_tokenizer: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_dir = tmp_path / "head"
    flags = ["--steps", "3", "--max-prompts", "8", "--max-tokens", "24", "--window", "4", "--spec-len", "2"]
    code, out, err = cli(["train-draft", "--model", str(tiny_with_tokenizer), *flags, "--output", str(out_dir)], capsys)
    assert code == 0, err
    assert "step     1  loss" in out and "acceptance by position" in out and f"wrote {out_dir}" in out
    config = json.loads((out_dir / eagle.CONFIG_FILE).read_text())
    assert config["steps"] == 3 and config["seed"] == 0 and len(config["prompt_set_hash"]) == 64
    assert config["shape"]["hidden"] == 64 and len(config["acceptance_by_position"]) == 2
    base = ["generate", "w5 w6 w7 w5 w6", "--model", str(tiny_with_tokenizer), "--max-tokens", "10", "--json", "-q"]
    code, out, err = cli(base, capsys)
    assert code == 0, err
    want = json.loads(out.splitlines()[-1])["outputs"][0]["token_ids"]
    code, out, err = cli([*base, "--spec-method", "eagle", "--eagle-head", str(out_dir), "--spec-fixed"], capsys)
    assert code == 0, err
    assert json.loads(out.splitlines()[-1])["outputs"][0]["token_ids"] == want


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--time-budget", "0"], "--time-budget: expected a number of minutes in [0.05, 1440], got '0'"),
        (["--window", "0"], "--window: expected an integer in [1, 64], got '0'"),
        (["--time-budget", "x"], "--time-budget: expected a number of minutes in [0.05, 1440], got 'x'"),
        (["--steps", "0"], "--steps: expected an integer in [1, 10000000], got '0'"),
        (["--model", "/nonexistent/model"], "train-draft: "),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_train_draft_cli_errors(flags: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli(["train-draft", *flags], capsys)
    assert code == 2
    assert needle in err and len(err.strip().splitlines()) == 1


def test_train_draft_output_that_is_a_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    code, _, err = cli(["train-draft", "--output", str(f)], capsys)
    assert code == 2 and f"--output {f} exists and is not a directory" in err


def test_generate_cli_without_a_head_is_one_line(
    tiny_with_tokenizer: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(eagle, "head_dir", lambda fingerprint: tmp_path / fingerprint[:16])
    code, _, err = cli(["generate", "w5 w6", "--model", str(tiny_with_tokenizer), "--spec-method", "eagle"], capsys)
    assert code == 2 and "run `mechserve train-draft" in err and len(err.strip().splitlines()) == 1
