"""Benchmark of the GRPO-RoC algorithm layer against a plain NumPy implementation, on this machine's CPU.

  python -m experiments.bench_algo [--num_groups=512 --group_size=32 --keep=16 --seq_len=1024 --repeats=5]

Pieces, each timed per call after compilation (median of --repeats):
  penalties+RoC   tool_error_penalty + answer_format_penalty + roc_select (paper mode) on [groups, 2G]
  RoC release / uniform   roc_select in the other two modes (JAX only)
  advantages      group_advantages (grpo) on the kept [groups, G]
  loss+grad       policy_loss (GRPO-RoC defaults: token_mean, eps 0.2/0.28) and its gradient w.r.t. logp on
                  [groups*G, seq_len] tokens
  full step       all of the above in one jitted call, gathering the kept rollouts' token arrays
The NumPy baseline is what one would write first: RoC loops over groups as the released code does
(``Generator.choice`` without replacement, P ∝ 1/(p_total + eps)), advantages and loss are vectorised with
the loss gradient written out by hand. Agreement columns compare the two on the same inputs (RoC: per-class
counts, as the random draws differ). Timings on a shared machine are noisy. The last line is one JSON object.
"""

from __future__ import annotations

import functools
import json
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags, logging

from experiments import bench_record
from rstar2jax import algo

_NUM_GROUPS = flags.DEFINE_integer("num_groups", 512, "Prompts.")
_GROUP_SIZE = flags.DEFINE_integer("group_size", 32, "Rollouts per prompt (2G).")
_KEEP = flags.DEFINE_integer("keep", 16, "Rollouts kept per prompt (G).")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 1024, "Response tokens per rollout.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed calls per piece (median reported).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed.")

EPS_LOW, EPS_HIGH, ROC_EPS = 0.2, 0.28, 1e-6


def median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def compiled_seconds(fn, repeats: int) -> tuple[float, float]:
    """(first call incl. compilation, median later call) in seconds."""
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start, median_seconds(fn, repeats)


# ----------------------------------------------------------------------------------------- NumPy baseline
def numpy_penalties(calls, failed, answers, turns):
    p_err = np.where(calls > 0, failed / np.maximum(calls, 1), 0.5)
    p_format = np.where(answers > 0, np.minimum(1.0, (answers - 1) / np.maximum(turns, 1)), 1.0)
    return p_err + p_format


def numpy_roc_paper(rng, rewards, p_total, keep):
    """Per-group loop: floor(n_neg/2) negatives uniformly, ceil(n_pos/2) positives ∝ 1/(p + eps)."""
    num_groups, _ = rewards.shape
    indices = np.zeros((num_groups, keep), np.int64)
    mask = np.zeros((num_groups, keep), bool)
    for g in range(num_groups):
        pos = np.flatnonzero(rewards[g] > 0)
        neg = np.flatnonzero(rewards[g] <= 0)
        k_neg = min(len(neg) // 2, keep)
        k_pos = min((len(pos) + 1) // 2, keep - k_neg)
        weights = 1.0 / (p_total[g, pos] + ROC_EPS)
        chosen = np.concatenate([
            rng.choice(neg, k_neg, replace=False),
            rng.choice(pos, k_pos, replace=False, p=weights / weights.sum()) if k_pos else [],
        ]).astype(np.int64)
        chosen.sort()
        indices[g, : len(chosen)] = chosen
        mask[g, : len(chosen)] = True
    return indices, mask


def numpy_grpo_advantages(rewards, mask, eps=1e-6):
    count = mask.sum(axis=1, keepdims=True)
    mean = np.where(mask, rewards, 0.0).sum(axis=1, keepdims=True) / np.maximum(count, 1)
    square_dev = np.where(mask, (rewards - mean) ** 2, 0.0).sum(axis=1, keepdims=True)
    std = np.sqrt(square_dev / np.maximum(count, 1))
    spread = np.where(mask, rewards, -np.inf).max(axis=1, keepdims=True) > np.where(
        mask, rewards, np.inf).min(axis=1, keepdims=True)
    return np.where(mask & spread & (count > 1), (rewards - mean) / (std + eps), 0.0)


def numpy_loss_and_grad(logp, old_logp, advantages, mask):
    """token_mean clipped surrogate and d loss / d logp, written out by hand."""
    raw = logp - old_logp
    ratio = np.exp(np.clip(raw, -20.0, 20.0))
    adv = advantages[:, None]
    unclipped = -adv * ratio
    clipped = -adv * np.clip(ratio, 1.0 - EPS_LOW, 1.0 + EPS_HIGH)
    tokens = max(mask.sum(), 1.0)
    loss = np.sum(np.maximum(unclipped, clipped) * mask) / tokens
    through = (unclipped >= clipped) & (np.abs(raw) < 20.0)
    grad = np.where(through, -adv * ratio, 0.0) * mask / tokens
    return loss, grad


# ----------------------------------------------------------------------------------------------- JAX side
def jax_penalties_and_roc(key, rewards, calls, failed, answers, turns, *, keep, mode):
    p_total = algo.tool_error_penalty(calls, failed) + algo.answer_format_penalty(answers, turns)
    valid = jnp.ones(rewards.shape, bool)
    return algo.roc_select(key, rewards, p_total, valid, keep=keep, mode=mode, eps=ROC_EPS)


def jax_loss_and_grad(logp, old_logp, advantages, mask):
    # dual_clip=None: the NumPy baseline above is the plain clipped surrogate.
    loss_fn = lambda lp: algo.policy_loss(
        lp, old_logp, advantages, mask, eps_low=EPS_LOW, eps_high=EPS_HIGH, dual_clip=None
    )
    return jax.value_and_grad(loss_fn, has_aux=True)(logp)


def jax_full_step(key, rewards, calls, failed, answers, turns, logp, old_logp, loss_mask, *, keep):
    """Penalties -> RoC -> gather kept rollouts -> advantages -> loss and d loss / d logp (all rollouts)."""
    selection = jax_penalties_and_roc(key, rewards, calls, failed, answers, turns, keep=keep, mode="paper")
    advantages = algo.group_advantages(selection.gather(rewards), selection.mask)
    kept_mask = selection.gather(loss_mask) * selection.mask[..., None]

    def loss_fn(logp):
        flat = lambda x: x.reshape(-1, x.shape[-1])
        return algo.policy_loss(flat(selection.gather(logp)), flat(selection.gather(old_logp)),
                                advantages.reshape(-1), flat(kept_mask), eps_low=EPS_LOW, eps_high=EPS_HIGH,
                                dual_clip=None)

    return jax.value_and_grad(loss_fn, has_aux=True)(logp)


def make_inputs(rng, num_groups, group_size, seq_len):
    shape = (num_groups, group_size)
    turns = 1 + rng.poisson(2.0, shape)
    lengths = rng.integers(seq_len // 8, seq_len + 1, shape)
    logp = -rng.exponential(0.7, shape + (seq_len,)).astype(np.float32)
    return dict(
        rewards=(rng.random(shape) < rng.beta(0.6, 0.6, (num_groups, 1))).astype(np.float32),
        calls=(turns - 1).astype(np.int32),
        failed=rng.binomial(turns - 1, 0.2).astype(np.int32),
        answers=rng.choice([0, 1, 2], p=[0.05, 0.85, 0.10], size=shape).astype(np.int32),
        turns=turns.astype(np.int32),
        logp=logp,
        old_logp=(logp + rng.normal(0.0, 0.2, logp.shape)).astype(np.float32),
        loss_mask=(np.arange(seq_len) < lengths[..., None]).astype(np.float32),
    )


def main(argv):
    del argv
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)
    num_groups, group_size, keep, seq_len = _NUM_GROUPS.value, _GROUP_SIZE.value, _KEEP.value, _SEQ_LEN.value
    repeats, numpy_repeats = _REPEATS.value, max(1, _REPEATS.value // 2)
    rng = np.random.default_rng(_SEED.value)
    x = make_inputs(rng, num_groups, group_size, seq_len)
    key = jax.random.key(_SEED.value)
    counts = (x["rewards"], x["calls"], x["failed"], x["answers"], x["turns"])
    p_total = numpy_penalties(x["calls"], x["failed"], x["answers"], x["turns"])
    rows, figures = [], {}

    def record(name, shape, jax_fn, numpy_fn=None):
        """Time one piece; returns the JAX result of its first (compiling) call."""
        start = time.perf_counter()
        first = jax.block_until_ready(jax_fn())
        row = dict(name=name, shape=shape, compile_s=time.perf_counter() - start, agreement="",
                   jax_s=median_seconds(jax_fn, repeats),
                   numpy_s=median_seconds(numpy_fn, numpy_repeats) if numpy_fn else None)
        rows.append(row)
        slug = name.replace("+", "_").replace(" ", "_")
        figures[f"{slug}_jax_ms"] = round(1e3 * row["jax_s"], 3)
        if numpy_fn:
            figures[f"{slug}_numpy_ms"] = round(1e3 * row["numpy_s"], 3)
            figures[f"{slug}_speedup"] = round(row["numpy_s"] / row["jax_s"], 2)
        return first

    roc = {m: jax.jit(functools.partial(jax_penalties_and_roc, keep=keep, mode=m)) for m in algo.ROC_MODES}
    selection = record("penalties+RoC", f"{num_groups}x{group_size}", lambda: roc["paper"](key, *counts),
                       lambda: numpy_roc_paper(rng, x["rewards"], numpy_penalties(
                           x["calls"], x["failed"], x["answers"], x["turns"]), keep))
    np_indices, np_mask = numpy_roc_paper(rng, x["rewards"], p_total, keep)
    np_positives = int(np.sum(np.take_along_axis(x["rewards"], np_indices, 1)[np_mask] > 0))
    same_counts = (int(selection.num_positives.sum()), int(selection.mask.sum())) == (np_positives,
                                                                                      int(np_mask.sum()))
    rows[-1]["agreement"] = f"class counts {'equal' if same_counts else 'DIFFER'}"
    for mode in ("release", "uniform"):
        record(f"RoC {mode}", f"{num_groups}x{group_size}", lambda mode=mode: roc[mode](key, *counts))

    kept_rewards = np.asarray(selection.gather(x["rewards"]))
    kept_valid = np.asarray(selection.mask)
    advantages_fn = jax.jit(algo.group_advantages)
    advantages = record("advantages", f"{num_groups}x{keep}", lambda: advantages_fn(kept_rewards, kept_valid),
                        lambda: numpy_grpo_advantages(kept_rewards, kept_valid))
    adv_diff = float(np.max(np.abs(np.asarray(advantages) - numpy_grpo_advantages(
        kept_rewards.astype(np.float64), kept_valid))))
    rows[-1]["agreement"] = f"max |diff| {adv_diff:.1e}"

    flat = lambda a: np.asarray(selection.gather(a)).reshape(-1, seq_len)
    logp, old_logp = flat(x["logp"]), flat(x["old_logp"])
    loss_mask = flat(x["loss_mask"]) * kept_valid.reshape(-1, 1)
    advantages = np.asarray(advantages).reshape(-1)
    loss_fn = jax.jit(jax_loss_and_grad)
    (loss, _), grad = record("loss+grad", f"{logp.shape[0]}x{seq_len}",
                             lambda: loss_fn(logp, old_logp, advantages, loss_mask),
                             lambda: numpy_loss_and_grad(logp, old_logp, advantages, loss_mask))
    np_loss, np_grad = numpy_loss_and_grad(logp.astype(np.float64), old_logp, advantages, loss_mask)
    loss_diff = abs(float(loss) - np_loss) / max(abs(np_loss), 1e-12)
    grad_diff = float(np.max(np.abs(np.asarray(grad) - np_grad)) / np.max(np.abs(np_grad)))
    rows[-1]["agreement"] = f"rel diff loss {loss_diff:.1e}, grad {grad_diff:.1e}"

    step = jax.jit(functools.partial(jax_full_step, keep=keep))
    tokens = (x["logp"], x["old_logp"], x["loss_mask"])

    def numpy_step():
        indices, mask = numpy_roc_paper(rng, x["rewards"], numpy_penalties(
            x["calls"], x["failed"], x["answers"], x["turns"]), keep)
        gather = lambda a: np.take_along_axis(a, indices[..., None], 1).reshape(-1, seq_len)
        adv = numpy_grpo_advantages(np.take_along_axis(x["rewards"], indices, 1), mask).reshape(-1)
        return numpy_loss_and_grad(gather(x["logp"]), gather(x["old_logp"]), adv,
                                   gather(x["loss_mask"]) * mask.reshape(-1, 1))

    record("full step", f"{num_groups}x{group_size}x{seq_len}", lambda: step(key, *counts, *tokens),
           numpy_step)

    print(f"GRPO-RoC algorithm layer on {jax.devices()[0]} ({platform.processor() or 'cpu'}): {num_groups} "
          f"prompts x {group_size} rollouts -> {keep} kept, {seq_len} tokens; per-call median of {repeats} "
          f"(NumPy {numpy_repeats}) after compilation")
    header = (f"{'piece':<15}{'shape':>16}{'compile s':>11}{'jax ms':>10}{'numpy ms':>11}{'speedup':>9}"
              "  agreement (same inputs)")
    print(header)
    print("-" * len(header))
    for r in rows:
        numpy_cells = (f"{1e3 * r['numpy_s']:>11.2f}{r['numpy_s'] / r['jax_s']:>8.1f}x" if r["numpy_s"]
                       else f"{'-':>11}{'-':>9}")
        print(f"{r['name']:<15}{r['shape']:>16}{r['compile_s']:>11.2f}{1e3 * r['jax_s']:>10.2f}{numpy_cells}"
              f"  {r['agreement']}")
    print("(shared 2-core machine, other jobs running: timings are noisy)")
    figures.update(device=str(jax.devices()[0]), num_groups=num_groups, group_size=group_size, keep=keep,
                   seq_len=seq_len, loss_rel_diff=loss_diff, grad_rel_diff=grad_diff, adv_max_diff=adv_diff,
                   roc_class_counts_equal=bool(same_counts))
    print(json.dumps(figures))


if __name__ == "__main__":
    bench_record.run(main)
