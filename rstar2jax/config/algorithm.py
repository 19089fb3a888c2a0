"""The algorithm's typed options, built once by the parser and read by the trainer: how one iteration turns
rollouts into a batch (:class:`RLIterationConfig`); the policy loss's are ``config.loss_config``'s."""

from __future__ import annotations

import dataclasses

from rstar2jax import algo
from rstar2jax.config.binding import key


@dataclasses.dataclass(frozen=True)
class RLIterationConfig:
    """How one iteration turns rollouts into a batch (paper: 2G = 32 sampled, G = 16 kept).

    Attributes:
      samples_per_problem: rollouts sampled per problem (2G).
      keep: rollouts kept per problem by RoC (G).
      roc_mode / min_negatives / min_positives / reject_equal_reward / roc_eps: ``algo.roc_select`` options.
      estimator / std / advantage_eps: ``algo.group_advantages`` options, with its defaults
        (``std``: ``algo.DEFAULT_STD``, the run config's ``rl.std`` too).
      seq_len: batch row length in positions (a prompt + response of n tokens takes n - 1).
      pack: pack several trajectories per row (segment ids keep them apart); False = one per row.
      row_multiple: rows divide into micro-batches and data shards (num_microbatches x data x fsdp).
      format_penalty: RoC's p_format rule, "paper" (Eq. 5) or "release"
        (``algo.answer_format_penalty_release``).
      mask_truncated: truncated responses stay in their group's advantage statistics but carry no loss and
        do not count in the loss normaliser (TRL's ``mask_truncated_completions``).
      overlong_buffer / overlong_penalty_factor: DAPO's soft overlong penalty (``algo.soft_overlong_penalty``
        over the last ``overlong_buffer`` tokens of the response budget, 0 = off) added to the reward the
        advantages are computed from (RoC still splits positives and negatives by the task reward).
    """

    samples_per_problem: int = key("rl.samples_per_problem", default=32)
    keep: int = key("rl.keep", default=16)
    roc_mode: str = key("rl.roc_mode", default="paper")
    min_negatives: int = key("rl.min_negatives", default=2)
    min_positives: int = key("rl.min_positives", default=2)
    reject_equal_reward: bool = key("rl.reject_equal_reward", default=True)
    roc_eps: float = key("rl.roc_eps", default=1e-6)
    estimator: str = key("rl.estimator", default="grpo")
    std: str = key("rl.std", default=algo.DEFAULT_STD)
    advantage_eps: float = key("rl.advantage_eps", default=1e-6)
    seq_len: int = 4096
    pack: bool = True
    row_multiple: int = 1
    format_penalty: str = key("rl.format_penalty", default="paper")
    mask_truncated: bool = key("rl.mask_truncated", default=False)
    overlong_buffer: int = key("rl.overlong_buffer", default=0)
    overlong_penalty_factor: float = key("rl.overlong_penalty_factor", default=1.0)

    def __post_init__(self):
        if not 1 <= self.keep <= self.samples_per_problem:
            raise ValueError(
                f"keep={self.keep} must be in [1, samples_per_problem={self.samples_per_problem}]"
            )
        if self.format_penalty not in algo.FORMAT_PENALTIES:
            raise ValueError(
                f"format_penalty={self.format_penalty!r}; expected one of {algo.FORMAT_PENALTIES}"
            )
        if self.overlong_buffer < 0 or self.overlong_penalty_factor < 0:
            raise ValueError(
                f"overlong_buffer ({self.overlong_buffer}) and overlong_penalty_factor "
                f"({self.overlong_penalty_factor}) must be >= 0"
            )
