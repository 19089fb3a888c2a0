"""Token-entropy analysis: reflection flags, the top-fraction split, word counts and the HTML rendering."""

import numpy as np
import pytest

from rstar2jax.data.trajectory import Trajectory
from rstar2jax.eval.token_entropy import (
    common_words,
    entropy_html,
    high_entropy_split,
    reflection_mask,
    sampled_tokens,
)


def _traj(mask, entropies, ids=None, problem_id="p"):
    n = len(mask)
    ids = list(range(10, 10 + n)) if ids is None else ids
    return Trajectory(problem_id, [1, 2], ids, list(mask), [0.0] * n, entropies=list(entropies))


def test_reflection_tokens_are_the_first_sampled_after_each_inserted_run():
    mask = [1, 1, 0, 0, 1, 1, 1, 0, 1]
    assert reflection_mask(mask, 2).tolist() == [0, 0, 0, 0, 1, 1, 0, 0, 1]
    assert not reflection_mask(mask, 0).any()
    assert not reflection_mask([1, 1, 1], 5).any()  # the first turn follows the prompt, not a tool
    with pytest.raises(ValueError, match="0/1"):
        reflection_mask([1, 2], 1)
    with pytest.raises(ValueError, match="window"):
        reflection_mask([1], -1)


def test_sampled_tokens_flatten_only_sampled_positions():
    a = _traj([1, 0, 1], [0.5, 0.0, 2.0], ids=[7, 8, 9])
    b = _traj([1, 1], [1.0, 3.0], ids=[4, 5])
    tokens = sampled_tokens([a, b], reflection_window=1)
    assert len(tokens) == 4
    assert tokens.token_ids.tolist() == [7, 9, 4, 5]
    assert tokens.entropies.tolist() == [0.5, 2.0, 1.0, 3.0]
    assert tokens.reflection.tolist() == [False, True, False, False]
    assert tokens.trajectory.tolist() == [0, 0, 1, 1] and tokens.position.tolist() == [0, 2, 0, 1]
    with pytest.raises(ValueError, match="trajectory 1 .*no entropies"):
        sampled_tokens([a, Trajectory("q", [1], [3], [1], [0.0])])


def test_split_counts_reflection_tokens_among_the_top():
    # 10 sampled tokens; reflection tokens (after the inserted one) carry the two largest entropies.
    mask = [1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1]
    ent = [0.1, 0.2, 0.3, 0.4, 0.0, 5.0, 4.0, 0.5, 0.6, 0.7, 0.8]
    tokens = sampled_tokens([_traj(mask, ent)], reflection_window=3)
    split = high_entropy_split(tokens, top_fraction=0.2)
    assert split.top.sum() == 2 and split.threshold == 4.0
    assert split.reflection_share_of_top == 1.0
    assert split.reflection_share_of_all == pytest.approx(0.3)
    assert split.enrichment == pytest.approx(1 / 0.3)
    assert split.mean_entropy == pytest.approx(np.mean([e for e, m in zip(ent, mask, strict=True) if m]))
    assert split.mean_entropy_reflection == pytest.approx((5.0 + 4.0 + 0.5) / 3)
    with pytest.raises(ValueError, match="top_fraction"):
        high_entropy_split(tokens, top_fraction=0.0)
    with pytest.raises(ValueError, match="no sampled tokens"):
        high_entropy_split(sampled_tokens([]))


def test_common_words_and_html():
    vocab = {4: " the", 5: "x", 6: "\n"}

    def decode(ids):
        return "".join(vocab[i] for i in ids)

    assert common_words(np.array([4, 5, 4, 6, 4]), decode, n=2) == [("the", 3), ("x", 1)]
    assert ("'\\n'", 1) in common_words(np.array([6]), decode)
    t = _traj([1, 0, 1], [2.0, 0.0, 1.0], ids=[4, 6, 5])
    page = entropy_html(t, decode)
    assert 'title="H=2.000" style="background:rgb(255,0,0)"' in page
    assert 'title="H=1.000" style="background:rgb(255,128,128)"' in page
    assert '<span style="color:#999">\n</span>' in page
