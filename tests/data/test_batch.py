"""Packing sequences into target-aligned token batches."""

import numpy as np
import pytest

from rstar2jax.data.batch import TokenSequence, build_batch, trajectory_sequence
from rstar2jax.data.trajectory import Trajectory


def test_packing_is_target_aligned_with_segments():
    a = TokenSequence(
        tokens=[10, 11, 12, 13], loss_mask=[0, 0, 1, 1], logprobs=[0, 0, -0.5, -0.25], advantage=2.0
    )
    b = TokenSequence(tokens=[20, 21, 22], loss_mask=[0, 1, 0], logprobs=[0, -1.0, 0], advantage=-1.0)
    c = TokenSequence(tokens=[30, 31, 32, 33, 34, 35], loss_mask=[0, 0, 0, 1, 1, 1])
    batch = build_batch([a, b, c], seq_len=6, num_rows=4, with_rl_fields=True)
    # a (3 positions) and b (2) share row 0; c (5) does not fit there and opens row 1; rows 2-3 are padding.
    np.testing.assert_array_equal(batch.tokens[0], [10, 11, 12, 20, 21, 0])
    np.testing.assert_array_equal(batch.targets[0], [11, 12, 13, 21, 22, 0])
    np.testing.assert_array_equal(batch.segment_ids[0], [1, 1, 1, 2, 2, 0])
    np.testing.assert_array_equal(batch.positions[0], [0, 1, 2, 0, 1, 0])
    np.testing.assert_array_equal(batch.loss_mask[0], [0, 1, 1, 1, 0, 0])
    np.testing.assert_array_equal(batch.old_logp[0], [0, -0.5, -0.25, -1.0, 0, 0])
    np.testing.assert_array_equal(batch.advantages[0], [2, 2, 2, -1, -1, 0])
    np.testing.assert_array_equal(batch.tokens[1], [30, 31, 32, 33, 34, 0])
    np.testing.assert_array_equal(batch.loss_mask[1], [0, 0, 1, 1, 1, 0])
    assert not batch.segment_ids[2:].any() and not batch.loss_mask[2:].any()
    assert batch.tokens.dtype == np.int32 and batch.loss_mask.dtype == np.float32

    padded = build_batch([a, b, c], seq_len=6, pack=False)
    assert padded.shape == (4, 6)  # 3 rows rounded up to a power of two
    np.testing.assert_array_equal(padded.segment_ids[:, 0], [1, 1, 1, 0])
    assert build_batch([a, b, c], seq_len=6).advantages is None  # SFT batches carry no RL fields


def test_row_bucketing_and_errors():
    seqs = [TokenSequence(tokens=[1, 2, 3], loss_mask=[0, 1, 1])] * 5
    assert build_batch(seqs, seq_len=2, pack=False, row_multiple=4).shape == (8, 2)
    assert build_batch(seqs, seq_len=2, pack=False, row_multiple=3).shape == (6, 2)
    assert build_batch(seqs[:1], seq_len=2, row_multiple=2).shape == (2, 2)
    with pytest.raises(ValueError, match="needs 3 positions but seq_len is 2"):
        build_batch([TokenSequence(tokens=[1, 2, 3, 4], loss_mask=[0, 0, 1, 1])], seq_len=2)
    with pytest.raises(ValueError, match="num_rows=4"):
        build_batch(seqs, seq_len=2, num_rows=4)
    with pytest.raises(ValueError, match="multiple of row_multiple"):
        build_batch(seqs, seq_len=2, num_rows=6, row_multiple=4)
    with pytest.raises(ValueError, match="same length"):
        TokenSequence(tokens=[1, 2], loss_mask=[0])
    with pytest.raises(ValueError, match="first token"):
        TokenSequence(tokens=[1, 2], loss_mask=[1, 1])


def test_trajectory_sequence_masks_prompt_and_tool_tokens():
    t = Trajectory(
        problem_id="p",
        prompt_ids=[5, 6],
        response_ids=[7, 8, 9],
        loss_mask=[1, 0, 1],
        logprobs=[-0.1, 0.0, -0.3],
    )
    seq = trajectory_sequence(t, advantage=0.5)
    assert list(seq.tokens) == [5, 6, 7, 8, 9]
    assert list(seq.loss_mask) == [0, 0, 1, 0, 1]
    assert list(seq.logprobs) == [0.0, 0.0, -0.1, 0.0, -0.3]
    assert seq.advantage == 0.5
    batch = build_batch([seq], seq_len=4, with_rl_fields=True)
    np.testing.assert_array_equal(batch.targets[0], [6, 7, 8, 9])
    np.testing.assert_array_equal(batch.loss_mask[0], [0, 1, 0, 1])
    np.testing.assert_allclose(batch.old_logp[0], [0, -0.1, 0, -0.3])
    with pytest.raises(ValueError, match="empty prompt"):
        trajectory_sequence(Trajectory("q", [], [1], [1], [0.0]), 1.0)
