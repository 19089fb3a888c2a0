import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from rstar2jax import algo
from tests.algo import reference

# (num_groups, group_size, keep): a few fixed shapes so that compilations stay few; raggedness is data.
# keep = group_size / 2, keep = group_size (odd), keep = 1, and group_size > 2 * keep.
SHAPES = [(3, 8, 4), (2, 7, 7), (2, 12, 1), (2, 12, 5)]


@st.composite
def roc_inputs(draw, shapes=tuple(SHAPES)):
    num_groups, group_size, keep = draw(st.sampled_from(shapes))
    shape = (num_groups, group_size)
    rewards = draw(hnp.arrays(np.float32, shape, elements=st.sampled_from([0.0, 1.0, -1.0, 0.5])))
    p_total = draw(hnp.arrays(np.float32, shape, elements=st.sampled_from([0.0, 0.25, 0.5, 1.0, 1.5, 2.0])))
    valid = draw(hnp.arrays(np.bool_, shape, elements=st.booleans() | st.just(True)))
    return dict(
        key=jax.random.key(draw(st.integers(0, 2**31 - 1))),
        rewards=rewards,
        p_total=p_total,
        valid=valid,
        keep=keep,
        min_negatives=draw(st.integers(0, 3)),
        min_positives=draw(st.integers(0, 3)),
        reject_equal_reward=draw(st.booleans()),
    )


def expected_counts(mode, n_neg, n_pos, args):
    keep = args["keep"]
    if mode == "paper":
        neg = min(n_neg // 2, keep)
        return neg, min(-(-n_pos // 2), keep - neg)
    if mode == "release":
        return reference.release_budgets(n_neg, n_pos, keep, args["min_negatives"], args["min_positives"])
    return None, min(keep, n_neg + n_pos)  # uniform: only the total is fixed


def check_group(mode, args, g, sel):
    rewards, p_total, valid, keep = args["rewards"][g], args["p_total"][g], args["valid"][g], args["keep"]
    indices, mask = np.asarray(sel.indices[g]), np.asarray(sel.mask[g])
    num_neg, num_pos = int(sel.num_negatives[g]), int(sel.num_positives[g])
    positive = rewards > 0
    n_neg, n_pos = int(np.sum(valid & ~positive)), int(np.sum(valid & positive))

    assert indices.shape == (keep,) and len(set(indices.tolist())) == keep  # distinct, padding included
    np.testing.assert_array_equal(mask, np.arange(keep) < num_neg + num_pos)
    kept = indices[mask]
    assert np.all(valid[kept]), "an invalid rollout was kept"
    assert np.all(np.diff(kept) > 0), "kept rollouts are not in rollout order"
    assert int(np.sum(positive[kept])) == num_pos and int(np.sum(~positive[kept])) == num_neg

    all_equal = not valid.any() or rewards[valid].min() == rewards[valid].max()
    assert bool(sel.rejected[g]) == (args["reject_equal_reward"] and all_equal)
    if sel.rejected[g]:
        assert num_neg == num_pos == 0
        return

    want_neg, want_total = expected_counts(mode, n_neg, n_pos, args)
    if mode == "uniform":
        assert num_neg + num_pos == want_total
        return
    assert (num_neg, num_pos) == (want_neg, want_total)
    if mode == "release":
        assert num_neg + num_pos == min(keep, n_neg + n_pos)
        if args["min_negatives"] + args["min_positives"] <= keep:
            assert num_neg >= min(args["min_negatives"], n_neg)
            assert num_pos >= min(args["min_positives"], n_pos)
        # positives: lowest p_total first (stable); negatives: rollout order.
        valid_pos = np.flatnonzero(valid & positive)
        want_pos = valid_pos[np.argsort(p_total[valid_pos], kind="stable")[:num_pos]]
        want_neg_idx = np.flatnonzero(valid & ~positive)[:num_neg]
        np.testing.assert_array_equal(kept, np.sort(np.concatenate([want_pos, want_neg_idx])))


@pytest.mark.parametrize("mode", algo.ROC_MODES)
@settings(max_examples=25, deadline=None)
@given(args=roc_inputs())
def test_selection_properties(mode, args):
    sel = algo.roc_select(mode=mode, **args)
    num_groups = args["rewards"].shape[0]
    assert sel.indices.shape == sel.mask.shape == (num_groups, args["keep"])
    assert sel.indices.dtype == jnp.int32 and sel.mask.dtype == jnp.bool_
    for g in range(num_groups):
        check_group(mode, args, g, sel)
    again = algo.roc_select(mode=mode, **args)
    jax.tree.map(np.testing.assert_array_equal, sel, again)  # deterministic for a key


@pytest.mark.parametrize("mode", algo.ROC_MODES)
@settings(max_examples=5, deadline=None)
@given(args=roc_inputs(shapes=SHAPES[:1]))  # op-by-op execution compiles every op once per shape
def test_jit_equals_no_jit(mode, args):
    jitted = algo.roc_select(mode=mode, **args)
    with jax.disable_jit():
        eager = algo.roc_select(mode=mode, **args)
    jax.tree.map(np.testing.assert_array_equal, jitted, eager)


def selection_frequencies(rewards, p_total, valid, *, keep, eps, num_keys):
    """How often each rollout is kept, over ``num_keys`` keys (vmapped: one compiled call)."""
    keys = jax.random.split(jax.random.key(1234), num_keys)
    select = jax.vmap(lambda k: algo.roc_select(k, rewards, p_total, valid, keep=keep, eps=eps))
    sel = select(keys)
    kept = jnp.zeros((num_keys,) + rewards.shape).at[
        jnp.arange(num_keys)[:, None, None], jnp.arange(rewards.shape[0])[None, :, None], sel.indices
    ].add(sel.mask)
    assert np.all(np.asarray(kept) <= 1)
    return np.asarray(jnp.mean(kept, axis=0))


def test_paper_mode_inclusion_frequencies_match_enumeration():
    # group 0: 5 positives with penalties (0, 0.2, 0.5, 1, 2) and 4 negatives: 2 + 3 = keep are kept;
    # group 1: 4 positives with tied penalties, 4 negatives and an invalid slot: 2 + 2 < keep are kept.
    rewards = np.array([[1, 1, 1, 0, 1, 0, 1, 0, 0], [0, 1, 1, 0, 1, 0, 1, 0, 1]], np.float32)
    p_total = np.array([[0.0, 0.2, 0.5, 1.0, 1.0, 2.0, 2.0, 0.0, 0.0], [0, 0.5, 0.5, 0, 1.5, 1, 1.0, 0, 0]],
                       np.float32)
    valid = np.ones_like(rewards, bool)
    valid[1, 8] = False
    eps, num_keys = 0.1, 20000
    freq = selection_frequencies(rewards, p_total, valid, keep=5, eps=eps, num_keys=num_keys)

    for g in range(2):
        want = np.zeros(rewards.shape[1])
        pos = np.flatnonzero(valid[g] & (rewards[g] > 0))
        neg = np.flatnonzero(valid[g] & (rewards[g] <= 0))
        want[pos] = reference.inclusion_probabilities(1.0 / (p_total[g, pos] + eps), -(-len(pos) // 2))
        want[neg] = (len(neg) // 2) / len(neg)
        tolerance = 5.0 * np.sqrt(want * (1 - want) / num_keys) + 1e-3
        np.testing.assert_array_less(np.abs(freq[g] - want), tolerance)
    # The draw is genuinely random: no positive is always or never kept in group 0.
    assert np.all((freq[0, [1, 2, 4, 6]] > 0.02) & (freq[0, [1, 2, 4, 6]] < 0.98))


def test_paper_mode_zero_penalty_rollouts_come_first():
    # Three positives with p_total = 0 and three penalised ones: ceil(6/2) = 3 positives are kept, and with
    # the default eps the clean ones (weight 1e6 against <= 2) win for any key.
    rewards = np.array([[1, 1, 1, 1, 1, 1, 0, 0]], np.float32)
    p_total = np.array([[0.5, 0.0, 2.0, 0.0, 1.0, 0.0, 0.0, 0.0]], np.float32)
    valid = np.ones_like(rewards, bool)
    for seed in range(5):
        sel = algo.roc_select(jax.random.key(seed), rewards, p_total, valid, keep=4)
        kept = set(np.asarray(sel.indices[0])[np.asarray(sel.mask[0])].tolist())
        assert {1, 3, 5} <= kept and not kept & {0, 2, 4}
        assert int(sel.num_negatives[0]) == 1


def test_release_mode_worked_example():
    # n_neg = 2, n_pos = 6, keep = 4: round(2·4/8) = 1 is at/below the floor 2 -> 2 negatives, 2 positives.
    rewards = np.array([[1, 0, 1, 1, 0, 1, 1, 1]], np.float32)
    p_total = np.array([[0.5, 9, 0.0, 0.5, 9, 1.0, 0.0, 2.0]], np.float32)
    sel = algo.roc_select(jax.random.key(0), rewards, p_total, np.ones_like(rewards, bool), keep=4,
                          mode="release")
    np.testing.assert_array_equal(sel.indices, [[1, 2, 4, 6]])
    np.testing.assert_array_equal(sel.mask, [[True] * 4])


@pytest.mark.parametrize(
    "n_neg, n_pos, want",
    [
        (3, 7, (2, 3)),  # round(1.5) + round(3.5) = 6 > keep: the released code asserts; cap positives
        (5, 5, (2, 3)),  # round(2.5) + round(2.5) = 2 + 2 = 4 < keep: positives fill the free slot
        (1, 9, (0, 5)),  # round(0.5) = 0 (half to even) meets the floor 0: positives get keep - 0
        (2, 2, (2, 2)),  # fewer valid rollouts than keep: all kept
    ],
)
def test_release_mode_rounding_corner_cases(n_neg, n_pos, want):
    keep = 5
    rewards = np.zeros((1, 12), np.float32)
    rewards[0, n_neg : n_neg + n_pos] = 1.0
    valid = np.arange(12)[None, :] < n_neg + n_pos
    sel = algo.roc_select(jax.random.key(0), rewards, np.zeros_like(rewards), valid, keep=keep,
                          mode="release", min_negatives=0, min_positives=0)
    assert (int(sel.num_negatives[0]), int(sel.num_positives[0])) == want
    assert reference.release_budgets(n_neg, n_pos, keep, 0, 0) == want


def test_gather_picks_kept_rollouts():
    rewards = np.array([[1, 0, 1, 0], [0, 1, 1, 1]], np.float32)
    sel = algo.roc_select(jax.random.key(3), rewards, np.zeros_like(rewards), np.ones_like(rewards, bool),
                          keep=2, mode="uniform")
    tokens = np.arange(2 * 4 * 3).reshape(2, 4, 3)
    gathered = sel.gather(tokens)
    assert gathered.shape == (2, 2, 3)
    for g in range(2):
        np.testing.assert_array_equal(gathered[g], tokens[g, np.asarray(sel.indices[g])])
    want = np.take_along_axis(rewards, np.asarray(sel.indices), 1)
    np.testing.assert_array_equal(sel.gather(rewards), want)


def test_bfloat16_inputs_and_traced_hyper_parameters():
    rewards = jnp.array([[1, 0, 1, 1, 0, 1]], jnp.bfloat16)
    p_total = jnp.array([[0.5, 0, 0.0, 1.5, 0, 1.0]], jnp.bfloat16)
    valid = np.ones((1, 6), bool)

    @jax.jit
    def select(key, min_negatives, eps):
        return algo.roc_select(key, rewards, p_total, valid, keep=3, mode="release",
                               min_negatives=min_negatives, min_positives=1, eps=eps)

    sel = select(jax.random.key(0), 2, 1e-3)
    np.testing.assert_array_equal(sel.indices[0][sel.mask[0]], [1, 2, 4])  # floor 2 negatives, best positive
    sel = select(jax.random.key(0), 0, 1e-3)
    assert int(sel.num_negatives[0]) == 1 and int(sel.num_positives[0]) == 2


def test_bad_inputs_raise_clear_errors():
    key = jax.random.key(0)
    r = np.zeros((2, 4), np.float32)
    v = np.ones((2, 4), bool)
    with pytest.raises(ValueError, match=r"keep must be a Python int in \[1, group_size=4\]"):
        algo.roc_select(key, r, r, v, keep=5)
    with pytest.raises(ValueError, match="keep must be"):
        algo.roc_select(key, r, r, v, keep=0)
    with pytest.raises(ValueError, match="p_total must have the shape of rewards"):
        algo.roc_select(key, r, r[:, :3], v, keep=2)
    with pytest.raises(ValueError, match="unknown mode 'top_k'"):
        algo.roc_select(key, r, r, v, keep=2, mode="top_k")
    with pytest.raises(ValueError, match="eps must be a positive scalar"):
        algo.roc_select(key, r, r, v, keep=2, eps=0.0)
    with pytest.raises(ValueError, match="min_negatives must be a non-negative"):
        algo.roc_select(key, r, r, v, keep=2, min_negatives=-1)
    with pytest.raises(ValueError, match="rewards must have rank 2"):
        algo.roc_select(key, r[0], r[0], v[0], keep=2)
