"""A LoRA policy's adapters on disk and in checkpoints: the record of the base they belong to (its name, the
LoRA shape and a fingerprint of the base weights: :func:`base_record`, checked by :func:`check_base` before a
run resumes or a run folder loads) and the PEFT folder written beside an exported policy
(:func:`save_adapter`, :func:`adapter_folder`). The trainer's side of a LoRA run (the frozen base beside the
trained adapters) is ``rstar2jax.train.lora``."""

from __future__ import annotations

import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rstar2jax import models
from rstar2jax.config.options import ConfigError, ModelSource
from rstar2jax.models import peft_adapter

#: Checkpoint meta key of the base a LoRA run's adapters belong to.
META_KEY = "lora_base"


@jax.jit
def _moments(params):
    def moments(x):
        x = x.astype(jnp.float32)
        return jnp.stack([jnp.sum(x), jnp.sum(x * x)])

    return jax.tree.map(moments, params)


def fingerprint(params) -> dict[str, list[float]]:
    """Per base leaf, its sum and sum of squares (float32): what tells one base's weights from another's."""
    moments = jax.device_get(_moments(params))
    return {jax.tree_util.keystr(path): [float(v) for v in value]
            for path, value in jax.tree_util.tree_flatten_with_path(moments)[0]}


def describe(lora: models.LoraConfig) -> dict[str, Any]:
    """The adapters' shape as JSON: rank, alpha, targets, rslora."""
    return {"rank": lora.rank, "alpha": lora.alpha, "targets": list(lora.targets), "rslora": lora.rslora}


def base_record(source: ModelSource, lora: models.LoraConfig, params) -> dict[str, Any]:
    """The checkpoint meta's record of the base (from ``source``) the adapters belong to (see
    :func:`check_base`)."""
    return {"name": source.base_name, "lora": describe(lora), "fingerprint": fingerprint(params)}


def check_checkpoint(meta: dict | None, expected: dict[str, Any] | None, where: str) -> None:
    """A checkpoint of a LoRA run (its ``meta``) resumes only as the same LoRA run on the same base
    (``expected``: this run's :func:`base_record`), a full fine-tuning one only as full fine-tuning
    (``expected`` None); ``ConfigError`` otherwise, before the state is restored."""
    if meta is None:
        return
    if expected is not None:
        check_base(meta.get(META_KEY), expected, where)
    elif META_KEY in meta:
        raise ConfigError(f"{where} holds LoRA adapters ({meta[META_KEY]['lora']}), but "
                          "config.model.lora.rank is 0: set the LoRA fields or use another workdir")


def check_base(record: dict[str, Any] | None, expected: dict[str, Any], where: str) -> None:
    """Raises ``ConfigError`` when a checkpoint's base record (``record``, None: a checkpoint of a full
    fine-tuning run) disagrees with this run's (``expected``): other LoRA shape, other base weights."""
    if record is None:
        raise ConfigError(f"{where} holds a full fine-tuning checkpoint, but config.model.lora.rank > 0: use "
                          "another workdir for the LoRA run")
    if record["lora"] != expected["lora"]:
        raise ConfigError(f"{where} holds adapters of LoRA {record['lora']}, config.model.lora gives "
                          f"{expected['lora']}: use another workdir or the checkpoint's values")
    saved, now = record["fingerprint"], expected["fingerprint"]
    if saved.keys() != now.keys() or not all(_same_moments(saved[k], now[k]) for k in saved):
        raise ConfigError(f"{where} holds adapters of base {record['name']!r}; the base config.model gives "
                          f"({expected['name']!r}) has other weights")


def _same_moments(a: list[float], b: list[float]) -> bool:
    """Whether two leaves' (sum, sum of squares) are those of the same weights, allowing for another dtype
    (bfloat16 rounding moves the sum by about 2^-9 sqrt(sum of squares)); other weights of the same scale
    move it by about sqrt(sum of squares)."""
    (sum_a, squares_a), (sum_b, squares_b) = a, b
    scale = np.sqrt(max(squares_a, squares_b))
    close_sums = abs(sum_a - sum_b) <= 0.02 * scale + 1e-6
    return close_sums and bool(np.isclose(squares_a, squares_b, rtol=1e-2, atol=1e-6))


def save_adapter(adapters, source: ModelSource, model_config: models.ModelConfig, lora: models.LoraConfig,
                 policy_folder: str | pathlib.Path) -> pathlib.Path:
    """Writes ``adapters`` as a PEFT folder beside an exported policy (:func:`adapter_folder`), naming the
    run's base (``source.base_name``). With several processes the adapters are gathered and process 0
    writes."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        adapters = multihost_utils.process_allgather(adapters, tiled=True)
    out = adapter_folder(policy_folder)
    if jax.process_index() == 0:
        peft_adapter.save_peft_adapter(adapters, model_config, lora, out, base_model=source.base_name)
    return out


def adapter_folder(policy_folder: str | pathlib.Path) -> pathlib.Path:
    """Where the PEFT adapter of an exported LoRA policy goes: ``<policy folder>_adapter`` beside it."""
    policy_folder = pathlib.Path(policy_folder)
    return policy_folder.with_name(policy_folder.name + "_adapter")
