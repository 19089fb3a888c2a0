"""Resample-on-Correct on synthetic agentic rollouts: what each selection mode keeps.

  python -m experiments.roc_demo [--num_groups=512 --group_size=32 --keep=16 --seed=0]

Builds groups of 2G synthetic trajectories (reward, tool calls, failed calls, answer blocks, assistant turns;
correct trajectories fail fewer tool calls on average, as in the paper's Fig. 4), scores them with the
Eq. 4-5 penalties, down-samples 2G -> G with ``roc_select`` in the paper, release and uniform modes, computes
GRPO advantages on what was kept, and prints how the kept positives compare with all positives.
"""

from __future__ import annotations

import functools
import time

import jax
import numpy as np
from absl import app, flags, logging

from rstar2jax import algo

_NUM_GROUPS = flags.DEFINE_integer("num_groups", 512, "Prompts per batch.")
_GROUP_SIZE = flags.DEFINE_integer("group_size", 32, "Rollouts per prompt (2G).")
_KEEP = flags.DEFINE_integer("keep", 16, "Rollouts kept per prompt (G).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed for the synthetic data and the selection.")
_REJECT_EQUAL = flags.DEFINE_bool("reject_equal_reward", True, "Drop groups whose rewards are all equal.")


def synthetic_rollouts(rng: np.random.Generator, num_groups: int, group_size: int) -> dict[str, np.ndarray]:
    """Structured counts of ``[num_groups, group_size]`` trajectories, with a per-prompt difficulty."""
    shape = (num_groups, group_size)
    solve_rate = rng.beta(0.5, 0.5, (num_groups, 1))  # many prompts near 0 or 1, as in RL batches
    turns = np.minimum(1 + rng.poisson(2.0, shape), 10)
    tool_calls = turns - 1 + (rng.random(shape) < 0.1)  # a call per turn but the last; sometimes two
    tool_calls[rng.random(shape) < 0.12] = 0  # some rollouts never use the tool
    turns = np.where(tool_calls == 0, 1, turns)
    error_rate = rng.beta(1.2, 4.0, shape)
    correct = rng.random(shape) < solve_rate * (1.0 - 0.3 * error_rate)  # noisy code hurts a little
    failed = rng.binomial(tool_calls, np.where(correct, 0.6 * error_rate, error_rate))
    answer_blocks = rng.choice([1, 2, 3], p=[0.85, 0.11, 0.04], size=shape)
    answer_blocks[~correct & (rng.random(shape) < 0.2)] = 0  # no <answer>: never rewarded
    return dict(
        rewards=correct.astype(np.float32),
        num_tool_calls=tool_calls.astype(np.int32),
        num_failed_calls=failed.astype(np.int32),
        num_answer_blocks=answer_blocks.astype(np.int32),
        num_turns=turns.astype(np.int32),
    )


# (column, width, description) of the summary table.
COLUMNS = [
    ("neg/grp", 8, "negatives kept per (non-rejected) group"),
    ("pos/grp", 8, "positives kept per group"),
    ("tool_err", 9, "failed / all tool calls in kept positive trajectories (the paper's Fig. 4 quantity)"),
    ("p_err", 7, "mean tool-error penalty of the kept positives"),
    ("p_format", 9, "mean answer-format penalty of the kept positives"),
    ("clean", 7, "share of kept positives with p_total = 0"),
    ("no_tool", 8, "share of kept positives without a tool call (p_err = 0.5)"),
    ("multi_ans", 10, "share of kept positives with more than one <answer> block"),
    ("|A|pos", 8, "mean |GRPO advantage| of kept positives (computed after selection)"),
    ("|A|neg", 8, "mean |GRPO advantage| of kept negatives"),
    ("ms", 7, "one compiled roc_select call"),
]


def format_row(name: str, values: dict[str, float]) -> str:
    cells = (f"{values[c]:>{w}.3f}" if c in values else " " * w for c, w, _ in COLUMNS)
    return f"{name:<14}" + "".join(cells)


def positive_summary(data, p_err, p_format, chosen) -> dict[str, float]:
    """Statistics of the positive trajectories among ``chosen`` (bool ``[num_groups, group_size]``)."""
    positive = chosen & (data["rewards"] > 0)
    calls = data["num_tool_calls"][positive].sum()
    return {
        "tool_err": data["num_failed_calls"][positive].sum() / max(calls, 1),
        "p_err": p_err[positive].mean(),
        "p_format": p_format[positive].mean(),
        "clean": np.mean((p_err + p_format)[positive] == 0),
        "no_tool": np.mean(data["num_tool_calls"][positive] == 0),
        "multi_ans": np.mean(data["num_answer_blocks"][positive] > 1),
    }


def selection_summary(selection: algo.RocSelection, data, p_err, p_format, millis) -> dict[str, float]:
    """Per-class counts, kept-positive statistics and post-selection advantages of one selection."""
    shape = data["rewards"].shape
    mask = np.asarray(selection.mask)
    chosen = np.zeros(shape, bool)
    chosen[np.nonzero(mask)[0], np.asarray(selection.indices)[mask]] = True
    kept_rewards = selection.gather(data["rewards"])
    advantages = np.asarray(algo.group_advantages(kept_rewards, selection.mask))
    kept_rewards = np.asarray(kept_rewards)
    groups = max(int((~np.asarray(selection.rejected)).sum()), 1)
    return {
        "neg/grp": int(selection.num_negatives.sum()) / groups,
        "pos/grp": int(selection.num_positives.sum()) / groups,
        **positive_summary(data, p_err, p_format, chosen),
        "|A|pos": np.abs(advantages[mask & (kept_rewards > 0)]).mean(),
        "|A|neg": np.abs(advantages[mask & (kept_rewards <= 0)]).mean(),
        "ms": millis,
    }


def main(argv):
    del argv
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # absl's default INFO shows JAX's backend probing
    if not 1 <= _KEEP.value <= _GROUP_SIZE.value:
        raise app.UsageError(f"--keep must be in [1, --group_size={_GROUP_SIZE.value}]")
    rng = np.random.default_rng(_SEED.value)
    shape = (_NUM_GROUPS.value, _GROUP_SIZE.value)
    data = synthetic_rollouts(rng, *shape)
    p_err = np.asarray(algo.tool_error_penalty(data["num_tool_calls"], data["num_failed_calls"]))
    p_format = np.asarray(algo.answer_format_penalty(data["num_answer_blocks"], data["num_turns"]))
    p_total = p_err + p_format
    valid = np.ones(shape, bool)

    n_pos = (data["rewards"] > 0).sum(axis=1)
    print(f"RoC demo: {shape[0]} prompts x {shape[1]} rollouts -> keep {_KEEP.value} "
          f"(reject_equal_reward={_REJECT_EQUAL.value})")
    mixed = int(np.sum((n_pos > 0) & (n_pos < shape[1])))
    print(f"prompts: {mixed} mixed, {int(np.sum(n_pos == 0))} all wrong, "
          f"{int(np.sum(n_pos == shape[1]))} all right; p_total: mean {p_total.mean():.3f}, "
          f"share zero {np.mean(p_total == 0):.3f}\n")
    header = f"{'selection':<14}" + "".join(f"{c:>{w}}" for c, w, _ in COLUMNS)
    print(header)
    print("-" * len(header))
    print(format_row("all positives", positive_summary(data, p_err, p_format, valid)))
    key = jax.random.key(_SEED.value)
    for mode in algo.ROC_MODES:
        select = functools.partial(algo.roc_select, key, data["rewards"], p_total, valid, keep=_KEEP.value,
                                   mode=mode, reject_equal_reward=_REJECT_EQUAL.value)
        jax.block_until_ready(select())  # compile
        start = time.perf_counter()
        selection = jax.block_until_ready(select())
        millis = 1e3 * (time.perf_counter() - start)
        print(format_row(mode, selection_summary(selection, data, p_err, p_format, millis)))
    print()
    for column, _, description in COLUMNS:
        print(f"  {column:<10}{description}")


if __name__ == "__main__":
    app.run(main)
