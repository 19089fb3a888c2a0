"""The library's one way to mix seeds: :func:`mix_seed` turns a tuple of ints (a run's seed, a group index, a
sibling, a resume count, ...) into one well-mixed uint32 seed, so nearby tuples give unrelated streams
(NumPy's ``SeedSequence``, its hash of the whole tuple). The engine's per-slot sampling seeds, the agent's
group and session seeds and the trainer's per-stage streams all come from here."""

from __future__ import annotations

import numpy as np

#: Streams of a run's seed (:func:`stream_seed`): each stage's problem order and its hard-problem filter, as
#: ``(stride, first multiple)``. The strides are the primes the trainer has always offset the run's seed by
#: (so seeded runs keep their numbers); the filter starts at one stride, so stage 0 does not reuse the seed.
STREAMS = {"problem_order": (7919, 0), "hard_filter": (104729, 1)}


def mix_seed(*entropy: int) -> int:
    """A well-mixed uint32 seed from non-negative ints (each of any size)."""
    return int(np.random.SeedSequence([int(e) for e in entropy]).generate_state(1)[0])


def stream_seed(seed: int, stream: str, index: int) -> int:
    """The seed of ``stream`` (a key of :data:`STREAMS`) for stage ``index`` of a run seeded ``seed``:
    ``seed + stride * (index + first multiple)``."""
    if stream not in STREAMS:
        raise ValueError(f"stream={stream!r}; expected one of {tuple(STREAMS)}")
    stride, first = STREAMS[stream]
    return seed + stride * (index + first)
