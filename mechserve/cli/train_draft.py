"""``mechserve train-draft``: train an EAGLE draft head for a model on its own outputs (``mechserve.model.eagle_train``).

Prints the loss curve while it trains and the acceptance per position on held-out prompts at the end, and
writes the head where ``--spec-method eagle`` finds it (``$MECHSERVE_CACHE/eagle/<fingerprint>``, or
``--output``).  Importing this module never imports torch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mechserve.cli.errors import CliError
from mechserve.cli.parser import Bounded

HELP = "train an EAGLE draft head for a model on its own outputs (for --spec-method eagle)"
DEFAULT_BUDGET_MIN = 28.0  # generation, training and evaluation of the embedded SmolLM2 on a 2-core CPU


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's flags."""
    add = parser.add_argument
    add("--model", default="smollm2", help="the target model: smollm2 (the embedded one, default) or a directory")
    add(
        "--time-budget",
        type=Bounded(float, ge=0.05, le=24 * 60, unit="minutes"),
        default=DEFAULT_BUDGET_MIN,
        metavar="MIN",
        help=f"minutes for the whole run, generation included ({DEFAULT_BUDGET_MIN:g})",
    )
    add("--seed", type=Bounded(int, ge=0, le=2**31 - 1), default=0, help="seeds everything (0)")
    add(
        "--max-tokens",
        type=Bounded(int, ge=8, le=4096),
        default=192,
        metavar="N",
        help="tokens per generated answer (192)",
    )
    add(
        "--window",
        type=Bounded(int, ge=1, le=64),
        default=8,
        metavar="N",
        help="the most real rows the head attends to (8)",
    )
    add(
        "--spec-len",
        type=Bounded(int, ge=1, le=16),
        default=4,
        metavar="K",
        help="guesses per draft the training windows and the evaluation cover (4)",
    )
    add("--batch-size", type=Bounded(int, ge=1, le=4096), default=24, metavar="N", help="windows per step (24)")
    add("--lr", type=Bounded(float, ge=1e-7, le=1.0), default=1e-3, help="AdamW's peak learning rate (1e-3)")
    add(
        "--steps",
        type=Bounded(int, ge=1, le=10**7),
        default=None,
        metavar="N",
        help="train exactly N steps and generate one greedy pass (default: as many as the budget allows)",
    )
    add(
        "--max-prompts",
        type=Bounded(int, ge=2, le=10**6),
        default=None,
        metavar="N",
        help="use only the first N prompts of the shipped set (default: all)",
    )
    add(
        "--fr-vocab",
        type=Bounded(int, ge=0, le=10**7),
        default=8192,
        metavar="N",
        help="the training's cross-entropy runs over the N ids most frequent in the model's outputs, and the "
        "evaluation also measures drafting among them (FR-Spec); 0: the whole vocabulary (8192)",
    )
    add("--output", type=Path, default=None, metavar="DIR", help="where to write the head (default: the cache's)")


def run(args: argparse.Namespace) -> int:
    """Train and write the head; print the loss curve, the acceptance per position and where it went."""
    try:
        from mechserve.api.errors import ModelLoadError
        from mechserve.model.eagle_train import TrainSettings, train
    except ModuleNotFoundError as exc:
        raise CliError(f"train-draft needs {exc.name!r}: pip install 'mechserve[torch]'") from None
    if args.output is not None and args.output.exists() and not args.output.is_dir():
        raise CliError(f"--output {args.output} exists and is not a directory")
    settings = TrainSettings(
        time_budget_s=args.time_budget * 60.0,
        seed=args.seed,
        max_tokens=args.max_tokens,
        window=args.window,
        spec_len=args.spec_len,
        batch_size=args.batch_size,
        lr=args.lr,
        steps=args.steps,
        max_prompts=args.max_prompts,
        fr_vocab=args.fr_vocab,
    )

    def say(line: str) -> None:
        print(line, flush=True)

    try:
        result = train(args.model, settings, args.output, say)
    except (ModelLoadError, ValueError, OSError) as exc:
        raise CliError(f"train-draft: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    say("acceptance by position on held-out prompts (each given the guesses before it were accepted):")
    say("  position  " + "  ".join(f"{j + 1:>6d}" for j in range(len(result.acceptance))))
    say("  all ids   " + "  ".join(f"{a:6.3f}" for a in result.acceptance))
    say(f"  top {result.fr_vocab:<5d} " + "  ".join(f"{a:6.3f}" for a in result.acceptance_fr))
    say(
        f"mean kept tokens per step (estimated, {settings.spec_len} guesses): {result.kept:.3f} "
        f"(FR-Spec top {result.fr_vocab}: {result.kept_fr:.3f})"
    )
    say(f"wrote {result.directory} ({result.steps} steps on {result.tokens} output tokens)")
    sys.stdout.flush()
    return 0


__all__ = ["HELP", "add_arguments", "run"]
