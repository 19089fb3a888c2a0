"""LoRA training runs (``config.model.lora.rank`` > 0): the frozen base beside the trained adapters.

The LoRA options (``PolicyOptions.lora``, checked against the model and any starting adapter folder) come
from the config edge, ``config.options``. A LoRA run's ``TrainState.params`` are the adapters
(``models.lora``) and its optimizer state is theirs alone; the base weights are loaded from ``config.model``
at every start (fresh or resumed, in ``model.param_dtype``, e.g. bfloat16 while the adapters train in
``model.lora.dtype``) and are never written into a checkpoint. The checkpoint meta records instead which
base the adapters belong to (``lora_base``: its name, the LoRA shape and a fingerprint of the base
weights), checked before a run resumes.

:class:`FrozenBase` binds the base to the loops' protocols:

* the train step: ``step(state, batch)`` calls the jitted ``step(state, batch, base)`` (the base is an
  argument, never donated, with no gradient and no optimizer state; it is also the KL term's reference);
* rollouts: the engine reads a plain params tree, so each rollout call samples from the merged weights
  ``W + s A B`` (``models.lora.merge``, built in the compute dtype once per call: once per step, again
  for a look-ahead or partial-rollout call), freed when the rollout returns. With ``offload``
  (``colocate.optimizer_memory``) the base waits in host memory while the engine runs, so the rollout
  holds one copy of the weights (the merged one), as a full fine-tuning run does;
* export: the merged policy as an HF folder and the adapters alone as a PEFT folder
  (``rstar2jax.policy.adapters``, which also keeps the record of the base the adapters belong to).
"""

from __future__ import annotations

import functools

import jax

from rstar2jax import models
from rstar2jax.config.options import PolicyOptions
from rstar2jax.data.rollout_contract import (
    BatchRollout,
    SupportsClose,
    SupportsPartial,
    SupportsStats,
    SupportsStream,
)
from rstar2jax.models import peft_adapter
from rstar2jax.schedules import colocate


class FrozenBase:
    """The frozen base parameters of a LoRA run (see the module doc).

    Args:
      params: the base parameters (placed as the model's rules shard them).
      model_config: their model.
      lora: the adapters' shape.
      offload: the base waits in host memory while a rollout's engine runs.
    """

    def __init__(self, params, model_config: models.ModelConfig, lora: models.LoraConfig, *,
                 offload: bool = False):
        self.params = params
        self.model_config = model_config
        self.lora = lora
        self.offload = offload

    def bind(self, step):
        """``step(state, batch)`` of a jitted ``step(state, batch, base)`` (``make_rl_step(..., lora=)``)."""

        def bound(state, batch):
            return step(state, batch, self.params)

        return bound

    def merged(self, adapters, dtype: str | None = None):
        """The plain params tree ``W + s A B`` of ``adapters`` (``dtype``: every leaf cast to it)."""
        return models.lora.merge(self.params, adapters, self.lora, dtype)

    def rollout(self, rollout_fn) -> MergedRollout:
        """``rollout_fn`` taking adapters where it took params (see :class:`MergedRollout`)."""
        return merged_rollout(self, rollout_fn)


class MergedRollout:
    """A rollout that takes a LoRA run's adapters where ``rollout_fn`` takes params: each call samples from
    the base with the adapters merged in (in the compute dtype, the engine's). Of the trainer's rollout
    contract (``rstar2jax.data.rollout_contract``) it has exactly what ``rollout_fn`` declares: the call
    and ``partial`` sample from the merged policy; ``stream`` is ``rollout_fn``'s (the asynchronous
    schedule merges with :meth:`policy_params`, then copies); ``last_stats`` and ``close`` are
    ``rollout_fn``'s. Built by :func:`merged_rollout`, which picks the class of those capabilities."""

    def __init__(self, base: FrozenBase, rollout_fn):
        self.base, self.rollout_fn = base, rollout_fn

    def policy_params(self, adapters):
        """The weights the policy samples with: the base with ``adapters`` merged in (compute dtype)."""
        return self.base.merged(adapters, self.base.model_config.compute_dtype)

    def _merged_call(self, call, adapters, problems, **options):
        base = self.base
        merged = base.merged(adapters, base.model_config.compute_dtype)
        if base.offload:
            base.params = colocate.to_host(base.params)
        try:
            return call(merged, problems, **options)
        finally:
            del merged
            if base.offload:
                base.params = colocate.to_device(base.params)


class _MergedBatch(MergedRollout):
    def __call__(self, adapters, problems, **options):
        return self._merged_call(self.rollout_fn, adapters, problems, **options)


class _MergedPartial(MergedRollout):
    def partial(self, adapters, problems, **options):
        return self._merged_call(self.rollout_fn.partial, adapters, problems, **options)


class _ForwardedStream(MergedRollout):
    def stream(self, params, **options):
        return self.rollout_fn.stream(params, **options)


class _ForwardedStats(MergedRollout):
    @property
    def last_stats(self):
        return self.rollout_fn.last_stats


class _ForwardedClose(MergedRollout):
    def close(self) -> None:
        self.rollout_fn.close()


#: Each capability a wrapped rollout may declare, with the part of :class:`MergedRollout` that forwards it.
_FORWARDS = ((BatchRollout, _MergedBatch), (SupportsPartial, _MergedPartial),
             (SupportsStream, _ForwardedStream), (SupportsStats, _ForwardedStats),
             (SupportsClose, _ForwardedClose))


@functools.cache
def _merged_class(parts: tuple[type, ...]) -> type:
    return type(MergedRollout.__name__, parts or (MergedRollout,), {"__doc__": MergedRollout.__doc__})


def merged_rollout(base: FrozenBase, rollout_fn) -> MergedRollout:
    """A :class:`MergedRollout` of ``rollout_fn`` with the capabilities it declares, no other."""
    parts = tuple(part for capability, part in _FORWARDS if isinstance(rollout_fn, capability))
    return _merged_class(parts)(base, rollout_fn)


def initial_adapters(policy: PolicyOptions, mesh):
    """The adapters a fresh run starts from: the policy's ``source.adapter`` (a PEFT folder, the config's
    ``model.lora.adapter``), else new ones (A random, B zero: the base model's outputs) from
    ``source.seed``."""
    model_config, lora = policy.model, policy.lora
    if policy.source.adapter:
        _, host = peft_adapter.load_peft_adapter(
            policy.source.adapter, model_config, base_model=policy.source.base_name, dtype=lora.dtype
        )
        return jax.device_put(host, models.lora.lora_shardings(model_config, lora, mesh))
    key = jax.random.fold_in(jax.random.PRNGKey(policy.source.seed), 1)  # not the key of random base weights
    return models.lora.init_lora(model_config, lora, key, mesh=mesh)
