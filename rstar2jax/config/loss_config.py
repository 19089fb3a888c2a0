"""The RL loss's options (``loss.*`` of a run config): which registered policy loss (``loss.mode``), its own
options, pi_old's source, the KL / entropy terms, rollout correction and the decoupled objective."""

from __future__ import annotations

import dataclasses
from typing import Any

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

    ``off_policy_correction="decoupled"``: AReaL's objective (``algo.decoupled_objective`` of the loss):
    proximal log-probs recomputed by the trainer (whatever ``old_logprobs`` says), tokens weighted by
    min(pi_prox / pi_sampler, ``decoupled_is_cap``); ``rollout_mask`` may drop sequences, ``rollout_is_cap``
    must be None.

    ``mode`` picks the policy loss: a name of ``algo.POLICY_LOSSES`` ("ppo": the clipped surrogate above;
    "gspo", "decoupled", "cispo", "sapo", or one registered with ``algo.register_policy_loss``) or
    ``"module:function"``. The loss's options are this config's fields of the same name (``eps_low``,
    ``dual_clip``, ...) and, for the others, ``options`` (name, value) pairs; each is checked by the loss
    (:meth:`loss_options`). ``importance_sampling_level="sequence"`` with mode "ppo" is "gspo".
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
    mode: str = key("loss.mode", default="ppo")
    # The registered losses' own options are bound by name, not by ``key``: ``parse`` reads each
    # ``loss.<option>`` field a registered loss declares (``loss_options``), as losses register late.
    options: tuple[tuple[str, Any], ...] = ()

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
        self._check_mode_and_options()

    @property
    def rollout_correction(self) -> bool:
        return self.rollout_is_cap is not None or self.rollout_mask is not None

    @property
    def decoupled(self) -> bool:
        return self.off_policy_correction == "decoupled" or self.mode == "decoupled"

    def objective(self) -> algo.PolicyLoss:
        """The policy loss a step minimises: ``mode``'s (GSPO for "ppo" at the sequence level), made the
        decoupled objective when ``off_policy_correction="decoupled"``."""
        mode = "gspo" if self.mode == "ppo" and self.importance_sampling_level == "sequence" else self.mode
        loss = algo.get_policy_loss(mode)
        return algo.decoupled_objective(loss) if self.decoupled and mode != "decoupled" else loss

    def loss_options(self) -> dict[str, Any]:
        """The objective's options: this config's field of each option's name, else ``options``' value,
        else the loss's default; raises ``ValueError`` naming a bad one."""
        fields = {f.name for f in dataclasses.fields(self)} - {"mode", "options"}
        values = {**dict(self.options), **{name: getattr(self, name) for name in fields}}
        return self.objective().resolve(values)

    def _check_mode_and_options(self) -> None:
        objective = self.objective()  # a ValueError naming the mode when it names no loss
        if self.importance_sampling_level == "sequence" and self.mode not in ("ppo", "gspo"):
            raise ValueError(f"importance_sampling_level='sequence' is GSPO's ratio (mode 'ppo' or 'gspo'); "
                             f"mode={self.mode!r} has its own")
        known = set(objective.options) | set(algo.registered_loss_options())
        if unknown := [name for name, _ in self.options if name not in known]:
            raise ValueError(f"options: {unknown[0]!r} is not an option of mode={self.mode!r} "
                             f"({', '.join(objective.options) or 'it has none'}) nor of a registered loss")
        self.loss_options()


