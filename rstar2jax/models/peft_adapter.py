"""LoRA adapters as PEFT folders: ``adapter_config.json`` + ``adapter_model.safetensors``, the format
``peft.PeftModel.from_pretrained(base_model, folder)`` loads onto a transformers model (and vLLM serves).

PEFT's layout for a causal LM: tensor ``base_model.model.model.layers.{i}.{module}.lora_A.weight``
``[r, in_features]`` and ``...lora_B.weight`` ``[out_features, r]`` (``nn.Linear`` layout, head axes
flattened as the HF weights flatten them), module paths ``self_attn.q_proj`` ... ``mlp.down_proj``, and the
scale ``lora_alpha / r`` (``/ sqrt(r)`` with ``use_rslora``). Ours (``models.lora``) keeps the layer axis
first and the input axes before the rank: ``a[l] = lora_A.T`` and ``b[l] = lora_B.T``, reshaped.

Which modules an adapter wraps, and the options this library refuses, are resolved as peft resolves them
(:mod:`rstar2jax.models.peft_config`). Whether an adapter fits a base is decided by what matters: the
architecture it was trained on (peft's ``auto_mapping``) and every tensor's shape. Its
``base_model_name_or_path`` only names where it came from (a hub name, a folder on another machine): when it
differs from the base given, loading warns once naming both, or with ``strict_base`` refuses.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib

import jax
import numpy as np
import safetensors.numpy

from rstar2jax.models.config import ModelConfig
from rstar2jax.models.hf_checkpoint import SAFETENSORS_DTYPES, _SafetensorsDir
from rstar2jax.models.lora import LoraConfig, check_adapters, lora_specs
from rstar2jax.models.peft_config import ADAPTER_CONFIG, MODULES, AdapterSpec, architecture, read_adapter_spec

ADAPTER_WEIGHTS = "adapter_model.safetensors"
__all__ = ["ADAPTER_WEIGHTS", "load_peft_adapter", "same_base", "save_peft_adapter"]
_PREFIX = "base_model.model.model.layers"
_log = logging.getLogger(__name__)
_warned: set[tuple[str, str, str]] = set()  # (adapter folder, its base, the base given): warned once
# Tensors a folder may hold for peft options this library refuses, by their name's tail.
_VARIANT_TENSORS = {"lora_B.bias": "lora_bias", "lora_magnitude_vector": "use_dora",
                    "modules_to_save": "modules_to_save", "trainable_tokens": "trainable_token_indices"}


def _tensor_name(layer: int, target: str, part: str) -> str:
    return f"{_PREFIX}.{layer}.{MODULES[target]}.lora_{part.upper()}.weight"


def save_peft_adapter(
    adapters: dict, config: ModelConfig, lora: LoraConfig, path: str | os.PathLike, *, base_model: str = ""
) -> pathlib.Path:
    """Writes ``adapters`` as a PEFT LoRA folder at ``path`` (created if missing); ``base_model`` goes into
    ``base_model_name_or_path`` (the HF folder or hub name the adapters belong to). Returns the path."""
    check_adapters(adapters, config, lora)
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    arrays = {}
    for target, pair in adapters["layers"].items():
        a, b = (np.asarray(jax.device_get(pair[part])) for part in ("a", "b"))
        rank = a.shape[-1]
        for layer in range(config.num_layers):
            arrays[_tensor_name(layer, target, "a")] = np.ascontiguousarray(a[layer].reshape(-1, rank).T)
            arrays[_tensor_name(layer, target, "b")] = np.ascontiguousarray(b[layer].reshape(rank, -1).T)
    safetensors.numpy.save_file(arrays, path / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "auto_mapping": {"base_model_class": architecture(config), "parent_library":
                         f"transformers.models.{config.model_type}.modeling_{config.model_type}"},
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": list(lora.targets),
        "use_rslora": lora.rslora,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }
    (path / ADAPTER_CONFIG).write_text(json.dumps(adapter_config, indent=2) + "\n", encoding="utf-8")
    return path


def same_base(name: str, other: str) -> bool:
    """Whether two base-model names name the same model for certain: equal (up to a trailing ``/``) or the
    same folder. An empty name agrees with anything."""
    if not name or not other or name.rstrip("/") == other.rstrip("/"):
        return True
    return os.path.exists(name) and os.path.exists(other) and os.path.samefile(name, other)


def load_peft_adapter(
    path: str | os.PathLike, config: ModelConfig, *, base_model: str = "", dtype: str | None = None,
    strict_base: bool = False,
) -> tuple[LoraConfig, dict]:
    """``(LoraConfig, adapters)`` of a PEFT folder for the model of ``config`` (adapters as host arrays of the
    stored dtype, or ``dtype``; zero in the layers a projection is not adapted in). ``base_model``: the name
    of the base this is applied to; when the adapter's ``base_model_name_or_path`` names another, a warning
    (once), or with ``strict_base`` a ValueError. Raises ValueError naming the first problem: a peft option
    this library cannot apply, another architecture, a target the model lacks, a rank larger than a matrix,
    a missing, extra or wrongly shaped tensor."""
    path = pathlib.Path(path)
    spec = read_adapter_spec(path, config)
    if spec.base_class and spec.base_class != architecture(config):
        raise ValueError(f"adapter {path} was trained on a {spec.base_class}{_named(spec)}; this base is a "
                         f"{architecture(config)}")
    lora = spec.lora if dtype is None else LoraConfig(**{**spec.lora.__dict__, "dtype": dtype})
    try:
        specs = lora_specs(config, lora)["layers"]
    except ValueError as error:
        raise ValueError(f"adapter {path}: {error}") from None
    if not (path / ADAPTER_WEIGHTS).is_file():
        raise FileNotFoundError(f"adapter {path}: no {ADAPTER_WEIGHTS}")
    stored = _SafetensorsDir(os.fspath(path), files=[ADAPTER_WEIGHTS])
    names = {_tensor_name(layer, t, p): (t, p, layer) for t, layers in spec.layers.items() for p in ("a", "b")
             for layer in layers}
    _check_tensor_names(path, config, spec, set(stored.headers), set(names))
    adapters = {t: {p: np.zeros(s.shape, np.dtype(dtype or _stored_dtype(stored))) for p, s in pair.items()}
                for t, pair in specs.items()}
    for name, (target, part, layer) in names.items():
        leaf = adapters[target][part]
        hf = stored.array(name)
        expected = (lora.rank, int(np.prod(leaf.shape[1:-1]))) if part == "a" else (
            int(np.prod(leaf.shape[2:])), lora.rank)
        if tuple(hf.shape) != expected:
            raise ValueError(f"adapter {path}: tensor {name} has shape {tuple(hf.shape)}, this base needs "
                             f"{expected}: the adapter belongs to another model{_named(spec)}")
        leaf[layer] = hf.T.reshape(leaf.shape[1:])
    _check_base_name(path, spec.base_model, base_model, strict_base)
    return lora, {"layers": adapters}


def _named(spec: AdapterSpec) -> str:
    return f" ({spec.base_model})" if spec.base_model else ""


def _check_tensor_names(path, config: ModelConfig, spec: AdapterSpec, stored: set[str], expected: set[str]):
    """ValueError naming a stored tensor the resolved targets have no place for, or one they miss."""
    if extra := sorted(stored - expected):
        option = next((o for tail, o in _VARIANT_TENSORS.items() if tail in extra[0]), None)
        why = f"a {option} tensor, which this library cannot apply" if option else (
            f"no module of this {config.model_type} model of {config.num_layers} layers that target_modules "
            f"adapts holds it: the adapter belongs to another model{_named(spec)}")
        raise ValueError(f"adapter {path}: tensor {extra[0]} ({len(extra)} such in all): {why}")
    if missing := sorted(expected - stored):
        raise ValueError(f"adapter {path}: missing tensors, e.g. {missing[0]} ({len(missing)} in all), which "
                         "its target_modules adapt")


def _check_base_name(path: pathlib.Path, adapter_base: str, base_model: str, strict: bool) -> None:
    if same_base(adapter_base, base_model):
        return
    message = (f"adapter {path} names base model {adapter_base!r}, applied to {base_model!r}: the "
               "architecture and every tensor's shape fit")
    if strict:
        raise ValueError(f"{message}, but strict_base asks the names to agree")
    key = (str(path.resolve()), adapter_base, base_model)
    if key not in _warned:
        _warned.add(key)
        _log.warning("warning: %s (another model of the same shapes would fit too)", message)


def _stored_dtype(stored) -> np.dtype:
    dtypes = {stored.dtype(name) for name in stored.headers}
    if len(dtypes) != 1 or next(iter(dtypes)) not in SAFETENSORS_DTYPES:
        raise ValueError(f"adapter tensors have dtypes {sorted(dtypes)}; expected one of "
                         f"{sorted(SAFETENSORS_DTYPES)}")
    return SAFETENSORS_DTYPES[next(iter(dtypes))]
