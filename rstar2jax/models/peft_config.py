"""What a PEFT LoRA folder's ``adapter_config.json`` asks of a model, resolved as peft resolves it.

peft decides which modules of the transformers model an adapter wraps by each module's full name in the
causal LM (``model.layers.3.self_attn.q_proj``; ``peft.tuners.tuners_utils.check_target_module_exists``):

* ``target_modules`` a string: a regular expression the whole name must match (``re.fullmatch``), or
  ``"all-linear"`` (any case): every linear layer but the output head;
* ``target_modules`` a list: a name equal to an entry or ending in ``"." + entry`` (``"q_proj"``,
  ``"self_attn.q_proj"``, or the expanded list of full names peft writes for ``all-linear``); only then do
  ``layers_to_transform`` (with ``layers_pattern``) keep the layers they list;
* ``exclude_modules`` removes modules by the same rules (a string: a regex; a list: names or suffixes).

A module's rank and alpha are ``r`` and ``lora_alpha`` unless a key of ``rank_pattern`` / ``alpha_pattern``
matches the end of its name (``re.match(rf"(.*\\.)?({key})$", name)``).

:func:`read_adapter_spec` resolves these on the module names transformers gives the model of a
:class:`~rstar2jax.models.config.ModelConfig` (Qwen3 / Qwen2 / Llama) into the layers each projection is
adapted in. In the layer-stacked layout (``models.lora``) a layer a projection is not adapted in holds zero
adapters, which is exact: ``A = B = 0`` adds nothing to the merged weight, and when training continues it gets
no gradient either (``dA = s·xᵀ(dY Bᵀ)`` and ``dB = s·(x A)ᵀ dY`` are both zero), so it stays zero.
What this library cannot apply is refused, naming the peft option.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import re
from typing import Any

from rstar2jax.models.config import _ARCHITECTURES, ModelConfig
from rstar2jax.models.hf_checkpoint import _LAYER_TENSORS, hf_tensors
from rstar2jax.models.lora import LORA_TARGETS, LoraConfig

ADAPTER_CONFIG = "adapter_config.json"
#: peft's shorthand for every linear layer but the output head.
ALL_LINEAR = "all-linear"
#: Module path of each projection inside a decoder layer, from the HF tensor names (``self_attn.q_proj``).
MODULES = {leaf: name.removesuffix(".weight") for leaf, name, _ in _LAYER_TENSORS if leaf in LORA_TARGETS}
_LAYER_MODULE = re.compile(r"model\.layers\.(\d+)\.(.+)")
# Initialisations that rewrite the base weights (W - A B): an adapter saved unconverted needs that base.
_RESIDUAL_INITS = ("pissa", "olora", "corda")
_log = logging.getLogger(__name__)
# peft options that change what an adapter computes beyond W + s A B on the decoder's projections (or add
# weights elsewhere), each with what it does. Any value but None / False / "none" / empty is refused.
_REFUSED = {
    "use_dora": "DoRA: a trained magnitude vector rescales each merged weight",
    "lora_bias": "a bias trained on each lora_B",
    "bias": "the base model's biases trained with the adapter",
    "fan_in_fan_out": "weights stored transposed (GPT-2's Conv1D)",
    "modules_to_save": "whole modules trained and saved beside the adapter",
    "trainable_token_indices": "trained rows of the embedding",
    "target_parameters": "LoRA on parameters rather than linear modules (MoE experts)",
    "layer_replication": "decoder layers repeated to deepen the model",
    "alora_invocation_tokens": "Activated LoRA: the adapter acts only after its invocation tokens",
    "use_qalora": "QALoRA: the adapter reads pooled inputs",
    "use_bdlora": "BD-LoRA: block-diagonal factors",
    "kasa_config": "KaSA: a trained diagonal between A and B, on a truncated base",
    "arrow_config": "Arrow: routing between several adapters",
    "monteclora_config": "MonteCLoRA: sampled adapter weights",
    "megatron_config": "Megatron-parallel layers",
}


@dataclasses.dataclass(frozen=True)
class AdapterSpec:
    """A PEFT LoRA adapter resolved on one model.

    Attributes:
      lora: rank, alpha, rsLoRA and the projections adapted in at least one layer.
      layers: per adapted projection, the layers it is adapted in (the others hold zero adapters).
      base_model: the adapter's ``base_model_name_or_path`` ('' when it names none).
      base_class: the transformers class the adapter was trained on (peft's ``auto_mapping``), or ''.
    """

    lora: LoraConfig
    layers: dict[str, tuple[int, ...]]
    base_model: str = ""
    base_class: str = ""


def module_names(config: ModelConfig) -> list[str]:
    """The names of the modules of ``config``'s transformers causal LM (``model``, ``model.layers.0``,
    ``model.layers.0.self_attn.q_proj``, ..., ``lm_head``), the keys peft matches ``target_modules`` on."""
    names = {"lm_head"}
    for tensor in hf_tensors(config):
        parts = tensor.split(".")[:-1]  # the module holding the tensor, then each module above it
        names.update(".".join(parts[:end]) for end in range(1, len(parts) + 1))
    return sorted(names)


def projection_of(name: str) -> tuple[int, str] | None:
    """``(layer, projection)`` of a module name that is a decoder layer's adaptable projection, else None."""
    match = _LAYER_MODULE.fullmatch(name)
    if match is None:
        return None
    target = next((t for t, module in MODULES.items() if module == match.group(2)), None)
    return None if target is None else (int(match.group(1)), target)


def _listed(patterns: str | list[str], name: str) -> bool:
    """peft's rule for ``target_modules`` / ``exclude_modules``: a string is a regex matching the whole name,
    a list holds names or dotted suffixes."""
    if isinstance(patterns, str):
        return re.fullmatch(patterns, name) is not None
    return name in patterns or any(name.endswith(f".{p}") for p in patterns)


def _layer_kept(raw: dict[str, Any], name: str) -> bool:
    """peft's ``layers_to_transform`` / ``layers_pattern`` filter (list targets only): the module's layer
    index (the first number after ``<pattern>.``) must be listed."""
    wanted = raw.get("layers_to_transform")
    if wanted is None or wanted == []:
        return True
    patterns = raw.get("layers_pattern") or []
    patterns = [patterns] if isinstance(patterns, str) else patterns
    if not patterns:
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", name)
    else:
        match = next(filter(None, (re.match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", name) for p in patterns)),
                     None)
    if match is None:
        return False
    index = int(match.group("idx"))
    return index == wanted if isinstance(wanted, int) else index in wanted


def peft_targets(raw: dict[str, Any], name: str) -> bool:
    """Whether peft wraps the module ``name`` for the adapter config ``raw`` (see the module docstring)."""
    excluded = raw.get("exclude_modules")
    if excluded and _listed(excluded, name):
        return False
    targets = raw["target_modules"]
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    if name in targets:
        return True
    return any(name.endswith(f".{t}") for t in targets) and _layer_kept(raw, name)


def _pattern_value(pattern: dict[str, Any], name: str, default):
    """peft's ``get_pattern_key``: the value of the first key that matches the end of ``name``."""
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


def read_adapter_config(path: str | pathlib.Path) -> dict[str, Any]:
    """The JSON of a PEFT folder's ``adapter_config.json``; FileNotFoundError / ValueError naming the
    problem (no such file, not JSON, not a LoRA adapter)."""
    path = pathlib.Path(path)
    file = path / ADAPTER_CONFIG
    if not file.is_file():
        raise FileNotFoundError(f"adapter {path}: no {ADAPTER_CONFIG} (not a PEFT adapter folder)")
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"adapter {file}: not JSON ({error})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"adapter {file}: not a JSON object")
    if raw.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"adapter {path}: peft_type {raw['peft_type']!r}; only LORA adapters load")
    return raw


def _shown(value) -> str:
    """``value``'s repr, a long list of names cut to its first three."""
    if isinstance(value, list) and len(value) > 4:
        return f"[{', '.join(map(repr, value[:3]))}, ... ({len(value)} names)]"
    return repr(value)


def _check_options(raw: dict[str, Any], path) -> None:
    for key, what in _REFUSED.items():
        value = raw.get(key)
        if value not in (None, False, "none", "", [], {}):
            raise ValueError(f"adapter {path}: {key}={value!r} ({what}) is not supported: this library "
                             "applies W + s·A·B to the decoder layers' projections only")
    for key in ("target_modules", "exclude_modules"):
        value = raw.get(key)
        if value is not None and not isinstance(value, str) and not (
                isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise ValueError(f"adapter {path}: {key}={_shown(value)}; expected a regex or a list of module "
                             "names")
    if raw.get("target_modules") is None:
        raise ValueError(f"adapter {path}: target_modules is not set; it names no module to adapt")


def _matched_modules(raw: dict[str, Any], config: ModelConfig, path) -> dict[str, tuple[int, str]]:
    """Module name -> ``(layer, projection)`` of every module the adapter wraps in ``config``'s model."""
    given = raw["target_modules"]
    if isinstance(given, str) and given.lower() == ALL_LINEAR:
        everything = [f"model.layers.{layer}.{module}" for layer in range(config.num_layers)
                      for module in MODULES.values()]
        raw = {**raw, "target_modules": everything}
    matched = [name for name in module_names(config) if peft_targets(raw, name)]
    if not matched:
        raise ValueError(f"adapter {path}: target_modules={_shown(given)} matches no module of this "
                         f"{config.model_type} model of {config.num_layers} layers (another base model?)")
    modules = {name: projection_of(name) for name in matched}
    if other := [name for name, found in modules.items() if found is None]:
        raise ValueError(f"adapter {path}: target_modules={_shown(given)} adapts {other[0]!r}, "
                         f"which this library cannot: only the decoder layers' projections {LORA_TARGETS}")
    return modules


def _rank_and_alpha(raw: dict[str, Any], modules, path) -> tuple[int, float]:
    """The one ``(r, lora_alpha)`` of every adapted module; ValueError naming ``rank_pattern`` /
    ``alpha_pattern`` when they give modules different values."""
    found = {}
    for key, pattern_key, default in (("r", "rank_pattern", 8), ("lora_alpha", "alpha_pattern", 8)):
        pattern, default = raw.get(pattern_key) or {}, raw.get(key, default)
        values = {name: _pattern_value(pattern, name, default) for name in modules}
        distinct = sorted(set(values.values()), key=repr)
        if len(distinct) > 1:
            first = {v: name for name, v in values.items()}
            examples = ", ".join(f"{first[v]!r}: {v}" for v in distinct[:2])
            raise ValueError(f"adapter {path}: {pattern_key} gives the adapted modules different values of "
                             f"{key} ({examples}); this library applies one {key} to every module")
        found[key] = distinct[0]
    return found["r"], found["lora_alpha"]


def read_adapter_spec(path: str | pathlib.Path, config: ModelConfig) -> AdapterSpec:
    """The :class:`AdapterSpec` of the PEFT folder at ``path`` on the model of ``config``. ValueError naming
    the peft option this library cannot apply, a target it cannot adapt, or a target that matches nothing."""
    raw = read_adapter_config(path)
    _check_options(raw, path)
    init = str(raw.get("init_lora_weights", "")).lower()
    if init.startswith(_RESIDUAL_INITS):  # peft loads it as it is: so do we, saying what it needs
        _log.warning("warning: adapter %s has init_lora_weights=%r: it belongs to the residual base that "
                     "initialisation left, not the original one, unless it was saved converted (peft's "
                     "path_initial_model_for_weight_conversion)", path, raw["init_lora_weights"])
    modules = _matched_modules(raw, config, path)
    rank, alpha = _rank_and_alpha(raw, modules, path)
    layers: dict[str, list[int]] = {}
    for layer, target in modules.values():
        layers.setdefault(target, []).append(layer)
    try:
        targets = tuple(t for t in LORA_TARGETS if t in layers)
        lora = LoraConfig(rank=rank, alpha=float(alpha), targets=targets,
                          dropout=float(raw.get("lora_dropout") or 0.0), rslora=bool(raw.get("use_rslora")))
    except (TypeError, ValueError) as error:
        raise ValueError(f"adapter {path}: {error}") from None
    mapping = raw.get("auto_mapping") or {}
    return AdapterSpec(lora, {t: tuple(sorted(layers[t])) for t in lora.targets},
                       raw.get("base_model_name_or_path") or "", mapping.get("base_model_class") or "")


def architecture(config: ModelConfig) -> str:
    """The transformers class of ``config``'s model (``Qwen3ForCausalLM``)."""
    return _ARCHITECTURES[config.model_type]
