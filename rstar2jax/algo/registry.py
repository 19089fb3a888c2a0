"""Policy losses as registered pure functions, picked by name (``loss.mode``) or ``module:function``.

A policy loss is a function of the token inputs to the per-token loss it minimises and the metrics it
knows (what it clips), with its options as keyword arguments that have defaults:

    @algo.register_policy_loss("my_loss")
    def my_loss(inputs: algo.LossInputs, *, my_eps: float = 0.2) -> tuple[jax.Array, dict]:
        ratio = jnp.exp(inputs.log_ratio)                       # [B, T], 1 on masked positions
        return -inputs.advantages * jnp.minimum(ratio, 1 + my_eps), {"ratio_mean": inputs.mean(ratio)}

:func:`compute_policy_loss` does the rest for every loss alike: it checks and masks the inputs, calls the
loss, weights its tokens (``is_weights``), aggregates them (``losses.aggregate_loss``) and adds the KL and
entropy terms. A loss's metrics are masked token means (``LossInputs.mean``); ``approx_kl`` and ``pg_loss``
(and ``kl_loss`` / ``entropy`` when present) are added for every loss.

Options: every keyword argument with a default is an option; a run config sets it as ``loss.<option>``
(registered losses' options are run-config fields of their own), checked for the default's type and by the
``checks`` given at registration (a one-line error naming the option). Options of the same name are one
field shared by the losses that declare it (``eps_high``: the clipped surrogate's and CISPO's).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rstar2jax.algo.losses import importance_log_ratio

#: An option's check: (predicate, what a good value is), e.g. ``(lambda v: v > 0, "must be > 0")``.
OptionCheck = tuple[Callable[[Any], bool], str]


@dataclasses.dataclass(frozen=True)
class LossInputs:
    """What a policy loss sees, ``[B, T]`` each, in the compute dtype, zero where ``mask`` is 0:

    logp: log pi(a_t), the policy being updated (carries the gradient);
    old_logp: log pi_old(a_t) (pi_prox under the decoupled objective), a constant;
    advantages: A_t per token (a per-sequence advantage broadcast over its tokens), a constant;
    mask: 1 on loss tokens; segment_ids: the packed sequences of each row (None: a sequence per row);
    behaviour_logp: the sampler's log-probs under the decoupled objective (else None), a constant."""

    logp: jax.Array
    old_logp: jax.Array
    advantages: jax.Array
    mask: jax.Array
    segment_ids: jax.Array | None = None
    behaviour_logp: jax.Array | None = None

    @property
    def log_ratio(self) -> jax.Array:
        """x_t = clip(logp_t - old_logp_t, -20, 20) (0 where masked)."""
        return importance_log_ratio(self.logp, self.old_logp, self.mask)

    def mean(self, values: jax.Array) -> jax.Array:
        """The masked token mean sum_bt m_bt v_bt / max(sum_bt m_bt, 1)."""
        return jnp.sum(values * self.mask) / jnp.maximum(jnp.sum(self.mask), 1.0)


LossFn = Callable[..., tuple[jax.Array, dict[str, jax.Array]]]


@dataclasses.dataclass(frozen=True)
class PolicyLoss:
    """A registered loss: its ``name``, function, options (name -> default) and their ``checks``."""

    name: str
    fn: LossFn
    options: Mapping[str, Any]
    checks: Mapping[str, OptionCheck] = dataclasses.field(default_factory=dict)
    nullable: frozenset[str] = frozenset()

    def resolve(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """This loss's options: ``values``' where given (other keys ignored), else the defaults; raises
        ``ValueError`` naming the first bad one (``name=value: what it must be``)."""
        resolved = {}
        for option, default in self.options.items():
            value = values.get(option, default)
            if isinstance(value, jax.Array | np.ndarray):  # a traced or array hyper-parameter: the caller's
                resolved[option] = value
                continue
            problem = "" if value is None and option in self.nullable else _type_problem(value, default)
            if not problem and option in self.checks and value is not None:
                good, expectation = self.checks[option]
                problem = "" if good(value) else expectation
            if problem:
                raise ValueError(f"{option}={value!r}: {problem} (an option of loss {self.name!r})")
            resolved[option] = value
        return resolved

    def __call__(self, inputs: LossInputs, **options) -> tuple[jax.Array, dict[str, jax.Array]]:
        return self.fn(inputs, **options)


#: Registered policy losses by name (``register_policy_loss``); ``loss.mode`` picks one.
POLICY_LOSSES: dict[str, PolicyLoss] = {}


def _type_problem(value, default) -> str:
    if isinstance(default, bool):
        return "" if isinstance(value, bool) else "must be True or False"
    if isinstance(default, int | float):
        if value is None and isinstance(default, float):
            return "must be a number"
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            return "must be a finite number"
        return "" if isinstance(default, float) or isinstance(value, int) else "must be an integer"
    if isinstance(default, str):
        return "" if isinstance(value, str) else "must be a string"
    return ""


def _options_of(fn: Callable) -> tuple[dict[str, Any], frozenset[str]]:
    """A loss function's options (its keyword arguments after ``inputs``, each with a default) and those
    that may be None (a None default, or ``None`` in the annotation)."""
    parameters = list(inspect.signature(fn).parameters.values())
    if not parameters or parameters[0].kind not in (parameters[0].POSITIONAL_ONLY,
                                                    parameters[0].POSITIONAL_OR_KEYWORD):
        raise TypeError(f"a policy loss takes the LossInputs first: {fn!r}")
    options = {}
    for p in parameters[1:]:
        if p.default is p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise TypeError(f"policy loss option {p.name!r} of {fn!r} needs a default (options are keyword "
                            "arguments with defaults)")
        options[p.name] = p.default
    nullable = {p.name for p in parameters[1:] if p.default is None or "None" in str(p.annotation)}
    return options, frozenset(nullable)


def as_policy_loss(fn: LossFn, name: str | None = None, checks: Mapping[str, OptionCheck] | None = None
                   ) -> PolicyLoss:
    """``fn`` as a :class:`PolicyLoss` (its options read from its signature), not registered."""
    options, nullable = _options_of(fn)
    if unknown := set(checks or {}) - set(options):
        raise TypeError(f"checks name {sorted(unknown)[0]!r}, not an option of {fn!r}")
    return PolicyLoss(name or getattr(fn, "__name__", repr(fn)), fn, options, dict(checks or {}), nullable)


def register_policy_loss(name: str, *, checks: Mapping[str, OptionCheck] | None = None,
                         overwrite: bool = False) -> Callable[[LossFn], LossFn]:
    """Decorator: registers ``fn(inputs: LossInputs, *, option=default, ...) -> (token_loss [B, T], metrics)``
    as policy loss ``name`` (``loss.mode=name``). ``checks``: option -> (predicate, "must be ...") beyond
    the default's type. Returns ``fn`` itself."""

    def add(fn: LossFn) -> LossFn:
        if not overwrite and name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered (pass overwrite=True)")
        POLICY_LOSSES[name] = as_policy_loss(fn, name, checks)
        return fn

    return add


def get_policy_loss(mode: str) -> PolicyLoss:
    """The loss ``mode`` names: a registered name, or ``module:function`` (importing the module, which may
    register it; an unregistered function is taken as it is). Raises ``ValueError`` in one line."""
    if mode in POLICY_LOSSES:
        return POLICY_LOSSES[mode]
    if not isinstance(mode, str) or mode.count(":") != 1:
        raise ValueError(f"mode={mode!r}: not a registered policy loss {tuple(POLICY_LOSSES)} nor "
                         "'module:function'")
    module_name, function_name = mode.split(":")
    try:
        fn = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"mode={mode!r}: cannot load it ({type(error).__name__}: {error})") from None
    for entry in POLICY_LOSSES.values():
        if entry.fn is fn:
            return entry
    try:
        return as_policy_loss(fn, mode)
    except TypeError as error:
        raise ValueError(f"mode={mode!r}: {error}") from None


def registered_loss_options() -> dict[str, tuple[Any, str]]:
    """Every registered loss's options: name -> (default, the losses declaring it), first default kept."""
    fields: dict[str, tuple[Any, str]] = {}
    for entry in POLICY_LOSSES.values():
        for option, default in entry.options.items():
            previous = fields.get(option, (default, ""))
            fields[option] = (previous[0], ", ".join(filter(None, (previous[1], entry.name))))
    return fields
