"""The sampler's random streams (``executor/sampling.py``): pinned stream seeds, the streams of one token
index distinct, a seeded row's uniform a function of (seed, stream, token index) alone, and the shared
generator seeded modulo 2**64.  Mutation testing found these unpinned (docs/mutation.md, `sampling`):
the executor tests compare a seeded run with another run of the same code, which any stream passes."""

from __future__ import annotations

import torch

from mechserve.api.params import SamplingParams
from mechserve.executor.sampling import STREAM_ACCEPT, STREAM_DRAFT, STREAM_SAMPLE, Row, Sampler, row_seed, stream_seed

SAMPLED = SamplingParams(temperature=1.0)


def seeded(seed: int, token_index: int) -> Row:
    return Row(SamplingParams(temperature=1.0, seed=seed), token_index)


def test_stream_seeds_are_pinned_and_the_sample_stream_is_the_seed_itself() -> None:
    """Pinned values: a change here changes every seeded request's drafts and acceptances (a compatibility break)."""
    assert stream_seed(42, STREAM_SAMPLE) == 42
    assert [stream_seed(42, s) for s in (STREAM_DRAFT, STREAM_ACCEPT)] == PINNED_STREAM_SEEDS
    assert len({stream_seed(7, s) for s in (STREAM_SAMPLE, STREAM_DRAFT, STREAM_ACCEPT)}) == 3
    assert all(0 <= stream_seed(s, STREAM_ACCEPT) < 2**64 for s in (-1, 0, 2**64 - 1))


PINNED_STREAM_SEEDS = [7760072293395518107, 3804914040087203106]


def test_a_seeded_rows_uniform_is_its_own_streams_draw_whatever_the_batch() -> None:
    mine = seeded(9, 3)
    alone = Sampler(seed=1).uniforms([mine])
    gen = torch.Generator().manual_seed(row_seed(stream_seed(9, STREAM_ACCEPT), 3))
    assert alone == [torch.empty(1, dtype=torch.float64).uniform_(generator=gen).item()]
    assert 0.0 <= alone[0] < 1.0
    batch = Sampler(seed=2).uniforms([Row(SAMPLED, 0), mine, seeded(10, 3)])
    assert batch[1] == alone[0] and batch[2] != alone[0]
    assert Sampler(seed=1).uniforms([mine], stream=STREAM_DRAFT) != alone
    assert Sampler(seed=1).uniforms([seeded(9, 4)]) != alone


def test_unseeded_rows_share_the_samplers_generator_seeded_modulo_2_64() -> None:
    rows = [Row(SAMPLED, 0)] * 3
    assert Sampler(seed=5).uniforms(rows) == Sampler(seed=5).uniforms(rows)
    assert Sampler(seed=5).uniforms(rows) != Sampler(seed=6).uniforms(rows)
    assert Sampler(seed=-1).uniforms(rows) == Sampler(seed=2**64 - 1).uniforms(rows)
    # in a mixed batch the unseeded rows take the shared generator's draws in row order
    plain = Sampler(seed=5).uniforms(rows)
    mixed = Sampler(seed=5).uniforms([Row(SAMPLED, 0), seeded(9, 3), Row(SAMPLED, 0)])
    assert (mixed[0], mixed[2]) == (plain[0], plain[2])
    logits = torch.zeros(2, 1000)
    draws = [Sampler(seed=s).choose(logits, [Row(SAMPLED, 0)] * 2) for s in (5, 5, 6)]
    assert draws[0] == draws[1] != draws[2]
