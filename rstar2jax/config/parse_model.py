"""The policy part of the run-config parser: the model (an HF folder, an HF config.json, a preset refined by
``model.spec`` fields, or inline fields) with its dtype / remat / attention options, its LoRA adapters, the
tokenizer folder and the conversation format. ``rstar2jax.config.parse`` calls :func:`policy_from_values` on
the values it checked; :func:`policy_options` reads the same part of a run's ``run_config.json`` (written by
this or an older version: missing fields take their defaults)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from rstar2jax import models
from rstar2jax.config import schema
from rstar2jax.config.options import ConfigError, ModelSource, PolicyOptions
from rstar2jax.data.conversation import PromptConfig, load_prompt_config
from rstar2jax.models import peft_adapter

#: ``config.model`` fields that are ``ModelConfig`` options of any model source.
MODEL_OPTIONS = ("param_dtype", "compute_dtype", "remat_policy", "scan_layers", "attention",
                 "attention_block_size", "mlp_chunk_size", "exact_kernels")


def prompt_from_values(values: Mapping[str, Any]) -> PromptConfig:
    """The conversation format of ``prompt.*``: ``paper`` None takes the one recorded in ``model.path``'s
    folder (an exported policy records it), else the paper's prompt; True the paper's (system text and the
    listed tool schema); False ``prompt``'s system prompt, user prefix and ``list_tools`` with the paper's
    Python tool and opener. SFT data and rollouts must use the same prompt."""
    paper, path = values["prompt.paper"], values["model.path"]
    own = PromptConfig(system_prompt=values["prompt.system_prompt"], user_prefix=values["prompt.user_prefix"],
                       list_tools=values["prompt.list_tools"])
    if paper:
        return PromptConfig()
    if paper is None:
        try:
            recorded = load_prompt_config(path) if path and os.path.isdir(path) else None
        except ValueError as error:  # the format file of model.path does not parse
            raise ConfigError(f"config.model.path={path!r}: {error}") from None
        return recorded or PromptConfig()
    return own


def prompt_from_config(config) -> PromptConfig:
    """The conversation format of a config's ``prompt`` section (a run config, or the demo config, whose
    prompt its SFT data are written in); without one (a record of an older SFT run), the paper's."""
    return prompt_from_values(_lenient_values(config, ("prompt.", "model.path")))


def tokenizer_from_values(values: Mapping[str, Any]) -> str:
    """The run's tokenizer folder: ``tokenizer``, else ``model.path`` when that folder holds a tokenizer (an
    exported policy does), else '' (none)."""
    tokenizer, path = values["tokenizer"], values["model.path"]
    if tokenizer:
        return tokenizer
    has_tokenizer = path and any(
        os.path.exists(os.path.join(path, name)) for name in ("tokenizer.json", "tokenizer_config.json")
    )
    return path if has_tokenizer else ""


def _model_error(error: Exception, values: Mapping[str, Any], spec: Mapping[str, Any]) -> ConfigError:
    """``error`` of building the ``ModelConfig`` as one line naming the config field it is about."""
    message = str(error)
    if isinstance(error, TypeError):
        unknown = re.search(r"unexpected keyword argument '(\w+)'", message)
        if unknown:  # an inline field ModelConfig does not have
            return ConfigError(f"config.model.spec.{unknown.group(1)}: not a ModelConfig field")
        # fields missing: an inline model without a preset names them all
        return ConfigError(f"config.model.spec: {message} (a preset's fields need model.preset)")
    for source in ("path", "config_json"):
        if values[f"model.{source}"]:
            return ConfigError(f"config.model.{source}={values[f'model.{source}']!r}: {message}")
    leading = re.match(r"\w+", message)  # ModelConfig's errors start with the field's name
    name = leading.group(0) if leading else ""
    if name in spec:
        return ConfigError(f"config.model.spec.{name}={spec[name]!r}: {message}")
    preset = values["model.preset"]
    return ConfigError(f"{f'config.model.preset={preset!r}' if preset else 'config.model.spec'}: {message}")


def model_from_values(values: Mapping[str, Any]) -> models.ModelConfig:
    """The ``ModelConfig`` of ``model.*``: ``path`` (an HF folder) wins, then ``config_json``, then ``preset``
    refined by ``spec`` fields, then ``spec`` alone; the dtype / remat / scan / attention options applied."""
    spec = dict(values["model.spec"])
    options = {name: values[f"model.{name}"] for name in MODEL_OPTIONS}
    folder, preset = values["model.path"] or values["model.config_json"], values["model.preset"]
    try:
        if folder:
            model = models.config_from_hf(folder, **options)
        elif preset:
            model = models.preset(preset, **{**spec, **options})
        else:
            model = models.ModelConfig(**{**spec, **options})
    except (ValueError, TypeError, OSError) as error:
        raise _model_error(error, values, spec) from None
    for name in ("eos_token_ids", "bos_token_id"):  # ModelConfig leaves token ids to the tokenizer
        ids = spec.get(name)
        ids = ids if isinstance(ids, list | tuple) else [] if ids is None else [ids]
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise ConfigError(f"config.model.spec.{name}={spec[name]!r}: token ids must be integers >= 0")
    return model


def lora_from_values(values: Mapping[str, Any], model: models.ModelConfig,
                     source: ModelSource) -> models.LoraConfig | None:
    """``model.lora`` as a ``LoraConfig`` checked against the model (None when ``rank`` is 0, LoRA off): a
    rank larger than a target matrix, or a ``model.lora.adapter`` folder that is not a PEFT LoRA folder, names
    another base, has another LoRA shape than the config or tensors this model has no place for, is one
    ``ConfigError`` before any weight is read."""
    rank, fields = values["model.lora.rank"], {
        "alpha": float(values["model.lora.alpha"]),
        "targets": tuple(values["model.lora.targets"]),
        "dropout": float(values["model.lora.dropout"]),
        "rslora": values["model.lora.rslora"],
        "dtype": values["model.lora.dtype"],
    }
    if not rank:
        return None
    lora = models.LoraConfig(rank=rank, **fields)
    try:
        models.lora.check_lora(model, lora)
    except ValueError as error:
        raise ConfigError(f"config.model.lora.rank={rank}: {error}") from None
    if source.adapter and os.path.isdir(source.adapter):
        folder = f"config.model.lora.adapter={source.adapter!r}"
        try:
            saved, _ = peft_adapter.load_peft_adapter(source.adapter, model, base_model=source.base_name)
        except (ValueError, FileNotFoundError) as error:
            raise ConfigError(f"{folder}: {error}") from None
        shape = ("rank", "alpha", "targets", "rslora")
        if differ := [k for k in shape if getattr(saved, k) != getattr(lora, k)]:
            raise ConfigError(
                f"{folder}: the adapter has " + ", ".join(f"{k}={getattr(saved, k)!r}" for k in differ)
                + "; set config.model.lora's fields to match to continue training it"
            )
    return lora


def policy_from_values(values: Mapping[str, Any]) -> PolicyOptions:
    """The :class:`PolicyOptions` of checked ``model.*``, ``tokenizer``, ``prompt.*`` and ``seed`` values."""
    source = ModelSource(
        path=values["model.path"],
        config_json=values["model.config_json"],
        preset=values["model.preset"],
        adapter=values["model.lora.adapter"],
        seed=values["seed"],
    )
    model = model_from_values(values)
    lora = lora_from_values(values, model, source)
    return PolicyOptions(model, source, lora, tokenizer_from_values(values), prompt_from_values(values))


def _lenient_values(config, prefixes: tuple[str, ...]) -> dict[str, Any]:
    """The config's values of the common fields starting with ``prefixes``, a field it lacks at its default
    (a record written before the field existed)."""
    values = {}
    for path, field in schema.COMMON.items():
        if not path.startswith(prefixes):
            continue
        node = config
        for part in path.split("."):
            node = node.get(part, field.default) if hasattr(node, "get") else field.default
        values[path] = node
    return values


def policy_options(config) -> PolicyOptions:
    """The :class:`PolicyOptions` of a run's recorded config (``run_config.json`` read back: the model,
    weights, LoRA shape, tokenizer and prompt it trained), checked as a run config's are."""
    values = _lenient_values(config, ("model.", "tokenizer", "prompt.", "seed"))
    for path, value in values.items():
        check = schema.COMMON[path].check
        if not check(value):
            raise ConfigError(f"config.{path}={value!r}: {check.expectation}")
    return policy_from_values(values)
