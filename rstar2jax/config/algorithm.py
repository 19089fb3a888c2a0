"""The algorithm's typed options, built once by the parser and read by the trainer: how one iteration turns
rollouts into a batch (:class:`RLIterationConfig`) and the policy loss (:class:`RLLossConfig`)."""

from __future__ import annotations

import dataclasses

from rstar2jax import algo
from rstar2jax.config.binding import key
from rstar2jax.config.vocabulary import OFF_POLICY_CORRECTIONS, OLD_LOGPROB_SOURCES


def correction_contradiction(old_logprobs: str, rollout_is_cap: float | None, rollout_mask: str | None, *,
                             decoupled: bool) -> tuple[tuple[str, ...], str] | None:
    """The loss's correction options that contradict each other, ``(the options, why)``, or None; the rule
    is stated here once: :class:`RLLossConfig` refuses it, and the config's rules name the config fields.

    The decoupled objective weights tokens by its own truncated ratio (``decoupled_is_cap``), so no
    ``rollout_is_cap`` beside it; outside it, the rollout correction compares the trainer's pi_old with the
    sampler's log-probs, so it needs ``old_logprobs="recompute"``."""
    if decoupled and rollout_is_cap is not None:
        return ("rollout_is_cap",), (
            f"the decoupled objective (off_policy_correction='decoupled') truncates the token weights at "
            f"decoupled_is_cap: rollout_is_cap must be None (rollout_mask may stay), got {rollout_is_cap}")
    correction = rollout_is_cap is not None or rollout_mask is not None
    if correction and old_logprobs != "recompute" and not decoupled:
        return ("rollout_is_cap", "rollout_mask"), (
            "rollout correction compares the trainer's π_old with the sampler's log-probs: it needs "
            "old_logprobs='recompute'")
    return None


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


@dataclasses.dataclass(frozen=True)
class RLLossConfig:
    """Options of the GRPO-RoC policy loss (paper defaults: ε 0.2/0.28, no KL, no entropy, token mean;
    dual-clip c = 3 as the released code on verl).

    ``old_logprobs`` picks where π_old comes from: ``"sampler"`` uses the log-probs the engine recorded while
    sampling; ``"recompute"`` evaluates them with the trainer's forward before the update (the two differ by
    the sampler/trainer numerical mismatch, e.g. under bfloat16). ``temperature`` divides the logits so the
    trainer scores the same distribution the sampler drew from.

    ``importance_sampling_level="sequence"`` is GSPO (``algo.gspo_log_ratio``) with its own clip range
    ``gspo_eps_low`` / ``gspo_eps_high`` (the GSPO paper's 3e-4 / 4e-4) and no dual clip (as verl's GSPO).
    ``kl_coef`` > 0 adds ``kl`` (k1/k2/k3, "+" for straight-through) to a frozen reference policy, the
    state's ``ref_params``. Rollout correction (``algo.rollout_correction``, needs
    ``old_logprobs="recompute"``: π_train is the recomputed π_old, π_rollout the sampler's log-probs):
    ``rollout_is_cap`` C truncates the token weights at C; ``rollout_mask`` ("sequence" / "geometric")
    drops sequences whose ratio leaves [1/C', C'], C' = ``rollout_mask_threshold``.

    ``off_policy_correction="decoupled"``: AReaL's objective (``algo.decoupled_policy_loss``): proximal
    log-probs recomputed by the trainer (whatever ``old_logprobs`` says), tokens weighted by min(pi_prox /
    pi_sampler, ``decoupled_is_cap``); ``rollout_mask`` may drop sequences, ``rollout_is_cap`` must be None.
    """

    eps_low: float = key("loss.eps_low", default=0.2)
    eps_high: float = key("loss.eps_high", default=0.28)
    dual_clip: float | None = key("loss.dual_clip", default=3.0)
    agg: str = key("loss.agg", default="token_mean")
    entropy_coef: float = key("loss.entropy_coef", default=0.0)
    temperature: float = key("rollout.temperature", default=1.0)
    old_logprobs: str = key("loss.old_logprobs", default="sampler")
    importance_sampling_level: str = key("loss.importance_sampling_level", default="token")
    gspo_eps_low: float = key("loss.gspo_eps_low", default=3e-4)
    gspo_eps_high: float = key("loss.gspo_eps_high", default=4e-4)
    kl_coef: float = key("loss.kl_coef", default=0.0)
    kl: str = key("loss.kl", default="k3")
    rollout_is_cap: float | None = key("loss.rollout_is_cap", default=None)
    rollout_mask: str | None = key("loss.rollout_mask", default=None)
    rollout_mask_threshold: float = key("loss.rollout_mask_threshold", default=2.0)
    off_policy_correction: str = "none"
    decoupled_is_cap: float = key("loss.decoupled_is_cap", default=5.0)

    def __post_init__(self):
        if self.old_logprobs not in OLD_LOGPROB_SOURCES:
            raise ValueError(f"old_logprobs={self.old_logprobs!r}; expected one of {OLD_LOGPROB_SOURCES}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be positive, got {self.temperature}")
        if self.importance_sampling_level not in algo.IS_LEVELS:
            raise ValueError(
                f"importance_sampling_level={self.importance_sampling_level!r}; "
                f"expected one of {algo.IS_LEVELS}"
            )
        if self.kl not in algo.KL_ESTIMATORS:
            raise ValueError(f"kl={self.kl!r}; expected one of {tuple(algo.KL_ESTIMATORS)}")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if self.rollout_mask is not None and self.rollout_mask not in algo.SEQUENCE_RATIOS:
            raise ValueError(
                f"rollout_mask={self.rollout_mask!r}; expected None or one of {algo.SEQUENCE_RATIOS}"
            )
        if self.off_policy_correction not in OFF_POLICY_CORRECTIONS:
            raise ValueError(f"off_policy_correction={self.off_policy_correction!r}; expected one of "
                             f"{OFF_POLICY_CORRECTIONS}")
        contradiction = correction_contradiction(self.old_logprobs, self.rollout_is_cap, self.rollout_mask,
                                                 decoupled=self.decoupled)
        if contradiction:
            raise ValueError(" / ".join(contradiction[0]) + f": {contradiction[1]}")
        for name in ("rollout_is_cap", "rollout_mask_threshold", "decoupled_is_cap"):
            value = getattr(self, name)
            if value is not None and not value > 1:
                raise ValueError(f"{name} must be > 1, got {value}")

    @property
    def rollout_correction(self) -> bool:
        return self.rollout_is_cap is not None or self.rollout_mask is not None

    @property
    def decoupled(self) -> bool:
        return self.off_policy_correction == "decoupled"
