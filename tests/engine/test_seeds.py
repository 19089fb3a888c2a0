"""The one seed-mixing function and the trainer's seed streams give the numbers the library has always used
(the three copies of the ``SeedSequence`` line and the stage offsets they replace), so seeded runs, rollouts
and engine samples stay bit-identical."""

import pytest

from rstar2jax.engine.records import slot_seed
from rstar2jax.engine.seeds import mix_seed, stream_seed


def test_mix_seed_gives_the_numbers_of_seed_sequence():
    assert mix_seed(7, 3) == 3466196061  # np.random.SeedSequence([7, 3]).generate_state(1)[0]
    assert mix_seed(2**40, 0, 5) == 637071118  # wide ints enter whole
    assert slot_seed((2**40, 0, 5)) == 1387925762  # the engine's slots keep the low 32 bits of each


def test_stream_seeds_are_the_trainers_stage_offsets():
    assert [stream_seed(11, "problem_order", i) for i in range(3)] == [11, 11 + 7919, 11 + 2 * 7919]
    assert [stream_seed(11, "hard_filter", i) for i in range(2)] == [11 + 104729, 11 + 2 * 104729]
    with pytest.raises(ValueError, match="stream='order'"):
        stream_seed(11, "order", 0)
