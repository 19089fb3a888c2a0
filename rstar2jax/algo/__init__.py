"""GRPO-RoC algorithm core: group advantages, RoC selection, penalties, policy losses (pure jnp)."""

from rstar2jax.algo._checks import masked as masked_values
from rstar2jax.algo.advantages import (
    ADVANTAGE_ESTIMATORS,
    DEFAULT_STD,
    STD_MODES,
    AdvantageEstimator,
    GroupStats,
    group_advantages,
    group_stats,
    register_estimator,
)
from rstar2jax.algo.corrections import (
    SEQUENCE_RATIOS,
    gspo_log_ratio,
    rollout_correction,
    sequence_log_ratio,
    sequence_sum,
)
from rstar2jax.algo.losses import (
    AGG_MODES,
    IS_LEVELS,
    KL_ESTIMATORS,
    aggregate_loss,
    clipped_surrogate,
    dual_clipped,
    importance_log_ratio,
    importance_weighted,
    kl_penalty,
    loss_normalizer,
    policy_loss,
)
from rstar2jax.algo.penalties import (
    FORMAT_PENALTIES,
    answer_format_penalty,
    answer_format_penalty_release,
    soft_overlong_penalty,
    tool_error_penalty,
)
from rstar2jax.algo.roc import ROC_MODES, RocSelection, roc_select

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGG_MODES",
    "DEFAULT_STD",
    "FORMAT_PENALTIES",
    "IS_LEVELS",
    "KL_ESTIMATORS",
    "ROC_MODES",
    "SEQUENCE_RATIOS",
    "STD_MODES",
    "AdvantageEstimator",
    "GroupStats",
    "RocSelection",
    "aggregate_loss",
    "clipped_surrogate",
    "dual_clipped",
    "importance_log_ratio",
    "importance_weighted",
    "kl_penalty",
    "answer_format_penalty",
    "answer_format_penalty_release",
    "group_advantages",
    "group_stats",
    "gspo_log_ratio",
    "loss_normalizer",
    "masked_values",
    "policy_loss",
    "register_estimator",
    "roc_select",
    "rollout_correction",
    "sequence_log_ratio",
    "sequence_sum",
    "soft_overlong_penalty",
    "tool_error_penalty",
]
