"""The tiny model as a conformance target, and targets for the deliberately broken executors."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings

from mechserve.conformance import Target, tiny_model, torch_target

CI = settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck), database=None)
"""Hypothesis settings for the tiny-model property tests (the whole conformance suite stays well under a
minute on 2 cores)."""


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """One intra-op thread: the tiny model gains nothing from two, and on a busy 2-core machine two
    threads spinning against another process make every step a hundred times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_pair() -> tuple[Any, Any]:
    """The built-in tiny model as ``(LlamaModel, transformers model)``."""
    return tiny_model()


@pytest.fixture(scope="session")
def target(tiny_pair: tuple[Any, Any]) -> Target:
    """``TorchExecutor`` on the tiny model, references from transformers."""
    model, hf = tiny_pair
    return torch_target(model, hf=hf, name="tiny")


def with_executor(target: Target, cls: type) -> Target:
    """``target`` (a ``torch_target``) running ``cls`` (a ``TorchExecutor`` subclass) over the same model."""
    model = target.model
    return dataclasses.replace(target, name=cls.__name__, make_executor=lambda p, s: cls(model, p, s))


@pytest.fixture(scope="session")
def mutant(target: Target) -> Callable[[type], Target]:
    """``mutant(cls)``: the tiny target with ``cls`` (a broken ``TorchExecutor``) as its executor."""
    return lambda cls: with_executor(target, cls)
