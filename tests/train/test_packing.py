"""Packing: first-fit decreasing rows, and rl_step on packed rows equal to rl_step on the same sequences
padded one per row (loss, every aggregation mode, metrics, update; micro-batched too)."""

import functools

import jax
import numpy as np
import optax
import pytest

from rstar2jax import algo
from rstar2jax.config.loss_config import RLLossConfig
from rstar2jax.data.batch import build_batch
from rstar2jax.data.packing import first_fit_decreasing
from rstar2jax.train.state import init_train_state
from rstar2jax.train.steps import make_rl_step, sequence_loss_normalizer
from tests.train.conftest import FAST_COMPILE, copy_tree, random_sequences


def test_first_fit_decreasing_places_longest_first():
    widths = [3, 2, 5, 4, 1, 6]
    rows = first_fit_decreasing(widths, 6)
    # 6 | 5+1 | 4+2 | 3: FFD's 4 rows (first-fit in order would also open 4, with 3+2+1 together)
    assert sorted(sorted(widths[i] for i in row) for row in rows) == [[1, 5], [2, 4], [3], [6]]
    assert [row[0] for row in rows] == sorted(row[0] for row in rows)
    assert all(row == sorted(row) and sum(widths[i] for i in row) <= 6 for row in rows)
    assert sorted(i for row in rows for i in row) == list(range(len(widths)))
    with pytest.raises(ValueError, match="sequence 1 needs 7 positions"):
        first_fit_decreasing([1, 7], 6)


def test_first_fit_decreasing_beats_first_fit_in_order():
    widths = [2, 2, 2, 4, 4, 4]  # in order: 2+2+2 | 4 | 4 | 4; decreasing: 4+2 three times
    assert len(first_fit_decreasing(widths, 6)) == 3


def test_normalizer_counts_packed_sequences():
    sequences = random_sequences(3, 12)
    packed = build_batch(sequences, seq_len=40, with_rl_fields=True)
    padded = build_batch(sequences, seq_len=40, pack=False, with_rl_fields=True)
    assert packed.shape[0] < padded.shape[0]
    for agg in algo.AGG_MODES:
        np.testing.assert_array_equal(
            sequence_loss_normalizer(packed.loss_mask, packed.segment_ids, agg=agg),
            algo.loss_normalizer(padded.loss_mask, agg=agg),
        )


@pytest.mark.parametrize("agg", algo.AGG_MODES)
def test_packed_rl_step_equals_padded(tiny_model, agg):
    config, params = tiny_model
    sequences = random_sequences(4, 12)
    packed = build_batch(sequences, seq_len=40, num_rows=4, with_rl_fields=True)
    padded = build_batch(sequences, seq_len=40, num_rows=12, pack=False, with_rl_fields=True)
    assert int(packed.segment_ids.max()) > 1  # several sequences share a row
    # Plain SGD, so the updated parameters compare the gradients themselves (AdamW's first step is
    # ~lr * sign(g), which turns float32 rounding of near-zero gradients into lr-sized differences).
    optimizer = optax.sgd(1.0)
    loss_config = RLLossConfig(agg=agg, entropy_coef=0.01, temperature=0.7)
    make = functools.partial(make_rl_step, config, optimizer, loss_config, compiler_options=FAST_COMPILE)
    results = {}
    for name, batch, micro in (("padded", padded, 1), ("packed", packed, 1), ("packed_micro", packed, 2)):
        state = init_train_state(copy_tree(params), optimizer, 0)
        results[name] = make(num_microbatches=micro)(state, jax.device_put(batch))
    reference_state, reference_metrics = results["padded"]
    for name in ("packed", "packed_micro"):
        state, metrics = results[name]
        assert metrics.keys() == reference_metrics.keys()
        for key in metrics:
            np.testing.assert_allclose(
                metrics[key], reference_metrics[key], rtol=2e-5, atol=1e-7, err_msg=key
            )
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
            state.params,
            reference_state.params,
        )
