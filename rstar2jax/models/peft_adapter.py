"""LoRA adapters as PEFT folders: ``adapter_config.json`` + ``adapter_model.safetensors``, the format
``peft.PeftModel.from_pretrained(base_model, folder)`` loads onto a transformers model (and vLLM serves).

PEFT's layout for a causal LM: tensor ``base_model.model.model.layers.{i}.{module}.lora_A.weight``
``[r, in_features]`` and ``...lora_B.weight`` ``[out_features, r]`` (``nn.Linear`` layout, head axes
flattened as the HF weights flatten them), module paths ``self_attn.q_proj`` ... ``mlp.down_proj``, and the
scale ``lora_alpha / r`` (``/ sqrt(r)`` with ``use_rslora``). Ours (``models.lora``) keeps the layer axis
first and the input axes before the rank: ``a[l] = lora_A.T`` and ``b[l] = lora_B.T``, reshaped.
"""

from __future__ import annotations

import json
import os
import pathlib

import jax
import numpy as np
import safetensors.numpy

from rstar2jax.models.config import ModelConfig
from rstar2jax.models.hf_checkpoint import _LAYER_TENSORS, SAFETENSORS_DTYPES, _SafetensorsDir
from rstar2jax.models.lora import LORA_TARGETS, LoraConfig, check_adapters, lora_specs

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model.model.layers"
#: Module path of each target inside a decoder layer, from the HF tensor names (``self_attn.q_proj``).
_MODULES = {leaf: name.removesuffix(".weight") for leaf, name, _ in _LAYER_TENSORS if leaf in LORA_TARGETS}
# PEFT options this format reader does not map onto ``LoraConfig``: a folder setting any of them is refused.
_UNSUPPORTED = {
    "use_dora": (False, None),
    "bias": ("none", None),
    "fan_in_fan_out": (False, None),
    "modules_to_save": (None, []),
    "layers_to_transform": (None, []),
    "rank_pattern": ({}, None),
    "alpha_pattern": ({}, None),
}


def _tensor_name(layer: int, target: str, part: str) -> str:
    return f"{_PREFIX}.{layer}.{_MODULES[target]}.lora_{part.upper()}.weight"


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


def read_adapter_config(path: str | os.PathLike) -> tuple[LoraConfig, str]:
    """``(LoraConfig, base_model_name_or_path)`` of a PEFT folder; ValueError naming what this library cannot
    load (another PEFT method, DoRA, biases, per-module ranks, a regex of target modules, ...)."""
    path = pathlib.Path(path)
    file = path / ADAPTER_CONFIG
    if not file.is_file():
        raise FileNotFoundError(f"adapter {path}: no {ADAPTER_CONFIG} (not a PEFT adapter folder)")
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"adapter {file}: not JSON ({error})") from None
    if raw.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"adapter {path}: peft_type {raw['peft_type']!r}; only LORA adapters load")
    for key, allowed in _UNSUPPORTED.items():
        if key in raw and raw[key] not in allowed:
            raise ValueError(f"adapter {path}: {key}={raw[key]!r} is not supported (allowed: {allowed[0]!r})")
    targets = raw.get("target_modules")
    if targets == "all-linear":  # PEFT's shorthand: every linear layer but the output head
        targets = list(LORA_TARGETS)
    if not isinstance(targets, list):
        raise ValueError(f"adapter {path}: target_modules={targets!r}; expected a list of module names")
    try:
        lora = LoraConfig(
            rank=raw.get("r"),
            alpha=float(raw.get("lora_alpha", 8)),
            targets=tuple(sorted(targets, key=lambda t: LORA_TARGETS.index(t) if t in LORA_TARGETS else -1)),
            dropout=float(raw.get("lora_dropout", 0.0)),
            rslora=bool(raw.get("use_rslora", False)),
        )
    except ValueError as error:
        raise ValueError(f"adapter {path}: {error}") from None
    return lora, raw.get("base_model_name_or_path") or ""


def same_base(name: str, other: str) -> bool:
    """Whether two base-model names agree: equal, the same folder, or the same last path component (a hub
    name ``org/Model`` and a local download ``/ckpt/Model``). An empty name agrees with anything."""
    if not name or not other or name == other:
        return True
    if os.path.exists(name) and os.path.exists(other) and os.path.samefile(name, other):
        return True
    return pathlib.PurePath(name.rstrip("/")).name == pathlib.PurePath(other.rstrip("/")).name


def load_peft_adapter(
    path: str | os.PathLike, config: ModelConfig, *, base_model: str = "", dtype: str | None = None
) -> tuple[LoraConfig, dict]:
    """``(LoraConfig, adapters)`` of a PEFT folder for the model of ``config`` (adapters as host arrays of the
    stored dtype, or ``dtype``). ``base_model``: the base this is to be applied to; a folder naming another
    base in ``base_model_name_or_path`` is refused. Raises ValueError naming the first problem: another base,
    a target the model lacks, a rank larger than a matrix, a missing, extra or wrongly shaped tensor."""
    path = pathlib.Path(path)
    lora, adapter_base = read_adapter_config(path)
    if not same_base(adapter_base, base_model):
        raise ValueError(f"adapter {path} belongs to base model {adapter_base!r}, not {base_model!r}")
    if dtype is not None:
        lora = LoraConfig(**{**lora.__dict__, "dtype": dtype})
    try:
        specs = lora_specs(config, lora)["layers"]
    except ValueError as error:
        raise ValueError(f"adapter {path}: {error}") from None
    if not (path / ADAPTER_WEIGHTS).is_file():
        raise FileNotFoundError(f"adapter {path}: no {ADAPTER_WEIGHTS}")
    stored = _SafetensorsDir(os.fspath(path), files=[ADAPTER_WEIGHTS])
    names = {_tensor_name(layer, t, p): (t, p, layer) for t in specs for p in ("a", "b")
             for layer in range(config.num_layers)}
    if extra := sorted(set(stored.headers) - set(names)):
        raise ValueError(f"adapter {path}: tensors this {config.model_type} model has no place for, e.g. "
                         f"{extra[0]} ({len(extra)} in all; another base model?)")
    if missing := sorted(set(names) - set(stored.headers)):
        raise ValueError(f"adapter {path}: missing tensors, e.g. {missing[0]} ({len(missing)} in all)")
    adapters = {t: {p: np.empty(spec.shape, np.dtype(dtype or _stored_dtype(stored)))
                    for p, spec in pair.items()} for t, pair in specs.items()}
    for name, (target, part, layer) in names.items():
        leaf = adapters[target][part]
        hf = stored.array(name)
        expected = (lora.rank, int(np.prod(leaf.shape[1:-1]))) if part == "a" else (
            int(np.prod(leaf.shape[2:])), lora.rank)
        if tuple(hf.shape) != expected:
            raise ValueError(f"adapter {path}: tensor {name} has shape {tuple(hf.shape)}, this base needs "
                             f"{expected} (another base model?)")
        leaf[layer] = hf.T.reshape(leaf.shape[1:])
    return lora, {"layers": adapters}


def _stored_dtype(stored) -> np.dtype:
    dtypes = {stored.dtype(name) for name in stored.headers}
    if len(dtypes) != 1 or next(iter(dtypes)) not in SAFETENSORS_DTYPES:
        raise ValueError(f"adapter tensors have dtypes {sorted(dtypes)}; expected one of "
                         f"{sorted(SAFETENSORS_DTYPES)}")
    return SAFETENSORS_DTYPES[next(iter(dtypes))]
