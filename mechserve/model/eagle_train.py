"""Training an EAGLE head on the target's own outputs (``mechserve train-draft``): self-distillation on a CPU.

1. **Generate**: the target answers the shipped prompt set (``eagle_prompts``) greedily, then, while the
   generation share of the time budget lasts, again with seeded sampling (temperature 0.8, seed
   ``seed + pass``): the contexts the head will meet are the model's own.
2. **Record**: one teacher-forced forward per sequence (prompt + output) records the target's feature ``f_p``
   (final hidden state) and its argmax ``a_p`` at every position from the prompt's last one on.
3. **Train** (EAGLE-1, arXiv 2401.15077): windows of ``window + spec_len`` consecutive rows; row ``p`` is fed
   ``(t_{p+1}, f_p + noise)`` (uniform noise of 0.1 x the features' standard deviation, EAGLE-1's remedy for
   the chain feeding back its own features) and trained to predict ``f_{p+1}`` (smooth L1) and ``a_{p+1}``
   through the frozen LM head (cross-entropy, weight ``cls_weight``, 0.1 in EAGLE-1); AdamW, seeded, a linear
   warm-up and a cosine decay over the training time (or ``steps``).  The cross-entropy runs over the
   ``fr_vocab`` ids most frequent in the training outputs (FR-Spec's ranking; labels outside it are left out):
   the LM head is most of a step's work, so a subset of 8192 of SmolLM2's 49152 ids trains about three times
   as many steps in the same time (0: the whole vocabulary).
4. **Evaluate** on held-out prompts (their greedy outputs): chain drafting of ``spec_len`` guesses from real
   windows, the acceptance per position (each conditional on the guesses before it) and the mean kept tokens
   per step, over the whole vocabulary and over the ``fr_vocab`` most frequent ids (FR-Spec).
5. **Write** the head (``eagle.save``) with its config, seed, prompt-set hash, steps, losses and acceptance.
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from mechserve.kv.paged import Span, build_attention_batch
from mechserve.model import eagle, eagle_prompts
from mechserve.model.eagle import EagleHead, HeadConfig, Shared

GENERATION_SHARE = 0.35  # of the time budget: generating and recording
EVAL_SHARE = 0.08  # of the time budget, kept for the evaluation at the end
EVAL_POSITIONS = 384  # held-out positions the evaluation drafts from


@dataclass(frozen=True, slots=True)
class TrainSettings:
    """What ``train`` does; ``time_budget_s``: the whole run, generation included (seconds); ``steps``: train
    exactly this many steps instead of until the budget's training share is spent."""

    time_budget_s: float = 30 * 60.0
    seed: int = 0
    max_tokens: int = 192
    window: int = eagle.DEFAULT_WINDOW
    spec_len: int = 4
    batch_size: int = 24
    lr: float = 1e-3
    cls_weight: float = 0.1
    steps: int | None = None
    held_out: int = 16
    fr_vocab: int = 8192  # 0: the whole vocabulary
    max_prompts: int | None = None
    generation_batch: int = 24


@dataclass(slots=True)
class Recorded:
    """One sequence: its ``ids`` (prompt + output), ``first`` (the prompt's last position), ``feats``
    [n, hidden] float32 and ``labels`` [n] int64 (the target's argmax) at positions ``first .. len(ids) - 1``."""

    ids: list[int]
    first: int
    feats: torch.Tensor
    labels: torch.Tensor


@dataclass(slots=True)
class Result:
    """What a run did: ``directory`` written, ``losses`` (step, loss, regression, classification), the
    acceptance per position over the whole vocabulary and over the FR-Spec subset, and counts."""

    directory: Path
    losses: list[tuple[int, float, float, float]] = field(default_factory=list)
    acceptance: list[float] = field(default_factory=list)
    acceptance_fr: list[float] = field(default_factory=list)
    kept: float = 1.0
    kept_fr: float = 1.0
    sequences: int = 0
    tokens: int = 0
    steps: int = 0
    fr_vocab: int = 0


def record(model: Any, ids: Sequence[int], first: int, page_size: int = 16) -> Recorded:
    """The target's features and argmax at positions ``first ..`` of ``ids`` (one teacher-forced forward)."""
    n = len(ids)
    pages = -(-n // page_size)
    arch = model.arch
    batch = build_attention_batch(
        [Span(0, 0, n, tuple(range(pages)))],
        list(range(n)),
        page_size,
        arch.num_heads // arch.num_kv_heads,
        model.distinct_sliding_windows,
    )
    hidden: list[torch.Tensor] = []
    logits = model.forward(
        torch.tensor(list(ids), dtype=torch.int64),
        torch.arange(n, dtype=torch.int64),
        model.new_cache(pages, page_size),
        batch,
        torch.arange(first, n, dtype=torch.int64),
        hidden_out=hidden,
    )
    return Recorded(list(ids), first, hidden[0].clone(), logits.argmax(dim=-1))


def generate(
    llm: Any,
    convs: Sequence[list[dict[str, str]]],
    settings: TrainSettings,
    deadline: float,
    say: Callable[[str], None],
    *,
    repeat: bool,
) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, output ids) of ``convs``: greedy first, then (``repeat``) seeded sampling passes until
    ``deadline`` (``time.monotonic()``).  Every chunk of ``generation_batch`` runs at once."""
    from mechserve.api.params import SamplingParams

    out: list[tuple[list[int], list[int]]] = []
    passes = 0
    while True:
        params = (
            SamplingParams(temperature=0.0, max_tokens=settings.max_tokens)
            if passes == 0
            else SamplingParams(temperature=0.8, seed=settings.seed + passes, max_tokens=settings.max_tokens)
        )
        for i in range(0, len(convs), settings.generation_batch):
            if time.monotonic() >= deadline and out:
                return out
            chunk = list(convs[i : i + settings.generation_batch])
            for o in llm.chat(chunk, params, use_tqdm=False):
                out.append((list(o.prompt_token_ids), list(o.outputs[0].token_ids)))
        passes += 1
        say(f"generated pass {passes}: {len(out)} answers, {sum(len(o) for _, o in out)} tokens")
        if not repeat or time.monotonic() >= deadline:
            return out


def draft_vocab(data: Sequence[Recorded], vocab: int) -> torch.Tensor:
    """Every id, the most frequent among the training outputs first (ties and unseen ids by id): FR-Spec's
    frequency ranking, computed on the model's own outputs. [vocab] int64."""
    counts: Counter[int] = Counter()
    for r in data:
        counts.update(r.ids[r.first + 1 :])
    ranked = sorted(range(vocab), key=lambda t: (-counts.get(t, 0), t))
    return torch.tensor(ranked, dtype=torch.int64)


def _segments(data: Sequence[Recorded], rows: int) -> list[tuple[int, int]]:
    """(sequence, first row) of every training window of ``rows`` rows."""
    found = []
    for s, r in enumerate(data):
        n = r.feats.shape[0]
        found += [(s, j) for j in range(0, n - rows)]  # rows j .. j + rows - 1 each need row + 1
    return found


def _batch(
    data: Sequence[Recorded], picks: Sequence[tuple[int, int]], rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [B, T] (t_{p+1}), feats [B, T, H] (f_p), positions [B, T], target feats [B, T, H], labels [B, T]."""
    ids, feats, pos, tgt, lab = [], [], [], [], []
    for s, j in picks:
        r = data[s]
        p0 = r.first + j
        ids.append(torch.tensor(r.ids[p0 + 1 : p0 + 1 + rows]))
        feats.append(r.feats[j : j + rows])
        pos.append(torch.arange(p0, p0 + rows))
        tgt.append(r.feats[j + 1 : j + 1 + rows])
        lab.append(r.labels[j + 1 : j + 1 + rows])
    return torch.stack(ids), torch.stack(feats), torch.stack(pos), torch.stack(tgt), torch.stack(lab)


def train_head(
    head: EagleHead,
    shared: Shared,
    data: Sequence[Recorded],
    settings: TrainSettings,
    deadline: float,
    say: Callable[[str], None],
) -> list[tuple[int, float, float, float]]:
    """Train ``head`` in place (module docstring, step 3) until ``deadline`` or ``settings.steps``; the
    loss curve as (step, loss, regression, classification), one entry per reported step."""
    rows = eagle.window_rows(settings.window, settings.spec_len)
    segments = _segments(data, rows)
    if not segments:
        raise ValueError(f"no training window of {rows} rows: the outputs are too short (raise --max-tokens)")
    rng = random.Random(settings.seed)
    gen = torch.Generator().manual_seed(settings.seed)
    noise = 0.1 * float(torch.cat([r.feats for r in data]).std())
    remap = None  # token id -> row of the subset's logits (-100: outside it, ignored)
    if shared.vocab_ids is not None:
        remap = torch.full((head.config.vocab,), -100, dtype=torch.int64)
        remap[shared.vocab_ids] = torch.arange(shared.vocab_ids.numel())
    opt = torch.optim.AdamW(head.parameters(), lr=settings.lr, weight_decay=0.0, betas=(0.9, 0.95))
    warmup = 20
    began = time.monotonic()
    span = max(1e-3, deadline - began)
    curve: list[tuple[int, float, float, float]] = []
    step = 0
    window_loss: list[tuple[float, float, float]] = []
    head.train()
    while True:
        if settings.steps is not None:
            if step >= settings.steps:
                break
            progress = step / max(1, settings.steps)
        else:
            now = time.monotonic()
            if now >= deadline and step > 0:
                break
            progress = (now - began) / span
        scale = min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))
        for g in opt.param_groups:
            g["lr"] = settings.lr * scale
        picks = [segments[rng.randrange(len(segments))] for _ in range(settings.batch_size)]
        ids, feats, pos, tgt, lab = _batch(data, picks, rows)
        noisy = feats + (torch.rand(feats.shape, generator=gen) - 0.5) * (2 * noise)
        pred = head(shared, ids, noisy, pos)  # [B, T, H]
        reg = F.smooth_l1_loss(pred, tgt)
        labels = lab.reshape(-1) if remap is None else remap[lab.reshape(-1)]
        if bool((labels >= 0).any()):
            ce = F.cross_entropy(shared.logits(pred.reshape(-1, pred.shape[-1])), labels, ignore_index=-100)
        else:
            ce = pred.sum() * 0.0
        loss = reg + settings.cls_weight * ce
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        step += 1
        window_loss.append((loss.item(), reg.item(), ce.item()))
        if step == 1 or step % 10 == 0:
            mean = [sum(v) / len(window_loss) for v in zip(*window_loss)]
            curve.append((step, mean[0], mean[1], mean[2]))
            window_loss = []
            say(f"step {step:5d}  loss {mean[0]:.4f}  regression {mean[1]:.4f}  cross-entropy {mean[2]:.4f}")
    if window_loss:  # the last steps since the last report
        mean = [sum(v) / len(window_loss) for v in zip(*window_loss)]
        curve.append((step, mean[0], mean[1], mean[2]))
        say(f"step {step:5d}  loss {mean[0]:.4f}  regression {mean[1]:.4f}  cross-entropy {mean[2]:.4f}")
    head.eval()
    return curve


def evaluate(head: EagleHead, shared: Shared, data: Sequence[Recorded], settings: TrainSettings) -> list[float]:
    """Chain acceptance per position on ``data`` (greedy outputs): guess ``j`` of a draft from position ``p`` is
    accepted when it and every guess before it equal the target's argmax; entry ``j - 1`` is the share of
    drafts whose guesses ``1 .. j`` were all accepted, divided by the share for ``1 .. j - 1``."""
    k, w = settings.spec_len, settings.window
    points = [(s, j) for s, r in enumerate(data) for j in range(0, r.feats.shape[0] - k)]
    random.Random(settings.seed + 1).shuffle(points)
    points = points[:EVAL_POSITIONS]
    if not points:
        return []
    hidden = head.config.hidden
    alive = [0] * (k + 1)
    for at in range(0, len(points), 64):
        chunk = points[at : at + 64]
        b = len(chunk)
        ids = torch.zeros(b, w, dtype=torch.int64)
        feats = torch.zeros(b, w, hidden)
        pos = torch.zeros(b, w, dtype=torch.int64)
        valid = torch.zeros(b, w, dtype=torch.bool)
        truth = torch.zeros(b, k, dtype=torch.int64)
        for i, (s, j) in enumerate(chunk):
            r = data[s]
            lo = max(0, j - w + 1)
            n = j + 1 - lo
            p0 = r.first + lo
            ids[i, w - n :] = torch.tensor(r.ids[p0 + 1 : p0 + 1 + n])
            feats[i, w - n :] = r.feats[lo : j + 1]
            pos[i, w - n :] = torch.arange(p0, p0 + n)
            valid[i, w - n :] = True
            truth[i] = r.labels[j + 1 : j + 1 + k]
        guesses = head.draft(shared, ids, feats, pos, valid, k)
        ok = (guesses == truth).int().cumprod(dim=1)  # [b, k]: guesses 1 .. j all right
        alive[0] += b
        for j in range(k):
            alive[j + 1] += int(ok[:, j].sum())
    return [alive[j + 1] / alive[j] if alive[j] else 0.0 for j in range(k)]


def train(
    model_name: str,
    settings: TrainSettings,
    output: Path | None = None,
    say: Callable[[str], None] = print,
) -> Result:
    """The whole recipe (module docstring) for the model ``model_name`` (``smollm2`` or a directory), into
    ``output`` (default ``eagle.head_dir``).  Raises ``ModelLoadError``, ``ValueError`` for settings the data
    cannot serve."""
    from mechserve.engine.executors import configure_threads
    from mechserve.entrypoints.llm import LLM
    from mechserve.model.loader import load_model

    configure_threads()
    started = time.monotonic()
    end = started + settings.time_budget_s
    torch.manual_seed(settings.seed)
    loaded = load_model(model_name, dtype=torch.float32)
    target: Any = loaded.model
    if not isinstance(target.lm_head, torch.Tensor):
        raise ValueError("train-draft needs the model's float weights (it trains through the LM head)")
    fingerprint = eagle.model_fingerprint(target)
    output = output or eagle.head_dir(fingerprint)
    convs = eagle_prompts.conversations(settings.seed)
    if settings.max_prompts is not None:
        convs = convs[: settings.max_prompts]
    held_out = min(settings.held_out, max(1, len(convs) // 4))
    train_convs, test_convs = convs[held_out:], convs[:held_out]
    say(
        f"train-draft: {model_name} (fingerprint {fingerprint[:16]}), {len(train_convs)} training and "
        f"{held_out} held-out prompts, seed {settings.seed}, budget {settings.time_budget_s / 60:.1f} min"
    )
    llm = LLM(loaded, max_running=settings.generation_batch)
    gen_deadline = started + settings.time_budget_s * GENERATION_SHARE
    test_pairs = generate(llm, test_convs, settings, gen_deadline, say, repeat=False)
    pairs = generate(llm, train_convs, settings, gen_deadline, say, repeat=settings.steps is None)
    del llm  # its KV pool
    data = [record(target, p + o, len(p) - 1) for p, o in pairs if o]
    test = [record(target, p + o, len(p) - 1) for p, o in test_pairs if o]
    tokens = sum(len(o) for _, o in pairs)
    say(f"recorded {len(data)} sequences ({tokens} output tokens) in {time.monotonic() - started:.0f} s")
    head = EagleHead(HeadConfig.of(target, settings.window))
    head.init_weights(settings.seed)
    ranked = draft_vocab(data, target.arch.vocab_size)
    fr = min(settings.fr_vocab, target.arch.vocab_size) if settings.fr_vocab else target.arch.vocab_size
    subset = Shared(target, ranked[:fr].contiguous()) if fr < target.arch.vocab_size else Shared(target)
    train_deadline = end - settings.time_budget_s * EVAL_SHARE
    curve = train_head(head, subset, data, settings, train_deadline, say)
    acceptance = evaluate(head, Shared(target), test, settings)
    acceptance_fr = evaluate(head, subset, test, settings)
    result = Result(
        output,
        curve,
        acceptance,
        acceptance_fr,
        eagle.expected_kept(acceptance),
        eagle.expected_kept(acceptance_fr),
        len(data),
        tokens,
        curve[-1][0] if curve else 0,
        fr,
    )
    info = {
        "seed": settings.seed,
        "prompt_set_hash": eagle_prompts.prompt_set_hash(convs),
        "prompts": len(train_convs),
        "held_out_prompts": held_out,
        "sequences": len(data),
        "output_tokens": tokens,
        "steps": result.steps,
        "spec_len": settings.spec_len,
        "batch_size": settings.batch_size,
        "lr": settings.lr,
        "cls_weight": settings.cls_weight,
        "max_tokens": settings.max_tokens,
        "time_budget_min": settings.time_budget_s / 60,
        "seconds": round(time.monotonic() - started, 1),
        "loss_curve": [list(c) for c in curve],
        "acceptance_by_position": acceptance,
        "mean_kept_tokens_per_step": result.kept,
        "fr_vocab": fr,
        "acceptance_by_position_fr_vocab": acceptance_fr,
        "mean_kept_tokens_per_step_fr_vocab": result.kept_fr,
    }
    eagle.save(output, head, ranked, target, fingerprint, info)
    return result


__all__ = ["Recorded", "Result", "TrainSettings", "draft_vocab", "evaluate", "record", "train", "train_head"]
