"""The one run-config parser: :func:`parse` turns a launcher's config (``ml_collections.ConfigDict``) into the
typed, frozen :class:`~rstar2jax.config.options.RunOptions` everything below the launchers reads, checking as
it goes and naming the first bad field in one line (:class:`ConfigError`: its full path, its value and what
is allowed), before anything is computed or written.

One pass, three steps: every field's value against its ``schema`` check (a field the schema does not know,
a misspelt one, is an error too; so are files that must exist and do not), then the rules between fields
(``rl.keep`` at most ``rl.samples_per_problem``, the rollout correction that off-policy tokens need, ...),
then the options are built, the library's own types included (``ModelConfig``, ``LoraConfig``,
``EngineConfig``, ``SamplingParams``, ``RLLossConfig``, ``RLIterationConfig``): whatever they refuse is
reported under the config field it came from. Reading a config touches no device (launchers parse before
``prepare_process``).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import os
import pathlib
import re
from collections.abc import Mapping
from typing import Any

from rstar2jax import algo
from rstar2jax.config import schema, schema_rl
from rstar2jax.config.algorithm import RLIterationConfig
from rstar2jax.config.binding import config_keys
from rstar2jax.config.checks import Check, Field
from rstar2jax.config.loss_config import RLLossConfig
from rstar2jax.config.options import (
    CheckpointOptions,
    ConfigError,
    DataOptions,
    DistributedOptions,
    LoggingOptions,
    MeshShape,
    OptimizerOptions,
    PolicyOptions,
    RLLoopOptions,
    RolloutOptions,
    RunOptions,
    SFTOptions,
    StageOptions,
    WandbOptions,
)
from rstar2jax.config.parse_model import policy_from_values
from rstar2jax.config.rules import common_rules, mismatch_correction, off_policy_correction, rl_rules
from rstar2jax.data.problems import looks_local
from rstar2jax.engine.config import DEFAULT_PAGE_SIZE, EngineConfig, SamplingParams
from rstar2jax.models.config import FP8, ModelConfig
from rstar2jax.models.quantization import check_weight_blocks

_MISSING = object()
#: Fields that moved, with where they went (a config written for an older version names them).
MOVED = {
    "loss.temperature": "use rollout.temperature, the one sampling temperature (the loss divides logits by "
    "it, as the sampler did)",
}
_DOES_NOT_EXIST = "does not exist"
_NO_PROBLEMS = "does not exist (a local path; hub dataset names are 'name' or 'org/name')"


class _Values(dict):
    """The checked values by path, remembering which ones the options were built from."""

    def __init__(self, *args):
        super().__init__(*args)
        self.read: set[str] = set()

    def __getitem__(self, path: str) -> Any:
        self.read.add(path)
        return super().__getitem__(path)


def _lookup(config, path: str) -> Any:
    node = config
    for part in path.split("."):
        if not hasattr(node, "keys") or part not in node:
            return _MISSING
        node = node[part]
    return node.to_dict() if hasattr(node, "to_dict") else node


def _exists(value: str, kind: str, check_data: bool) -> str:
    """What is wrong with the file ``value`` names ('' when nothing is)."""
    if not value or (kind in ("data", "problems") and not check_data):
        return ""
    if kind == "folder" and not os.path.isdir(value):
        return "is not a folder"
    if kind in ("path", "data") and not os.path.exists(value):
        return _DOES_NOT_EXIST
    if kind == "problems" and looks_local(value) and not os.path.exists(value):
        return _NO_PROBLEMS
    return ""


def _read(node, fields: Mapping[str, Field], prefix: str, check_data: bool) -> dict[str, Any]:
    """Every field's value, checked; ``prefix``: where ``node`` is in the config (``stages[1].``)."""
    values = {}
    for path, field in fields.items():
        value = _lookup(node, path)
        if value is _MISSING:
            raise ConfigError(f"config.{prefix}{path} is missing (a run config has every field of "
                              "config.rl_config() / sft_config(); --print_config lists them)")
        problem = "" if field.check(value) else field.check.expectation
        problem = problem or _exists(value, field.exists, check_data)
        if problem:
            raise ConfigError(f"config.{prefix}{path}={value!r}: {problem}")
        values[path] = value
    return values


def _unknown_fields(node, fields: Mapping[str, Field], where: str = "", prefix: str = "") -> None:
    """Raises ``ConfigError`` for the first field of ``node`` (at ``where`` in the config; ``prefix``: its
    path among ``fields``) that ``fields`` does not declare."""
    for key in node.keys():
        path = f"{prefix}{key}"
        if path in fields:
            continue
        if hasattr(node[key], "keys") and any(name.startswith(path + ".") for name in fields):
            _unknown_fields(node[key], fields, where, path + ".")
            continue
        hint = f"; {MOVED[path]}" if path in MOVED else ""
        if not hint and (close := difflib.get_close_matches(path, list(fields), n=1)):
            hint = f"; did you mean {where}{close[0]}?"
        raise ConfigError(f"config.{where}{path}: no such field{hint}")


def _mode_option_fields(config, fields: Mapping[str, Field]) -> dict[str, Field]:
    """The fields of the options of ``config.loss.mode``'s loss that ``fields`` lacks and the config sets (a
    ``module:function`` loss's, written in the config file as ``config.loss.<option> = value``); an option
    the config does not set keeps the loss's default."""
    mode = _lookup(config, "loss.mode")
    if mode is _MISSING or not fields["loss.mode"].check(mode):
        return {}  # reading loss.mode reports it
    loss = algo.get_policy_loss(mode)
    extra = {}
    for option, default in loss.options.items():
        path = f"loss.{option}"
        if path not in fields and _lookup(config, path) is not _MISSING:
            check = Check(lambda v, option=option: _resolves(loss, option, v), f"must be a valid {option} "
                          f"(an option of loss {mode!r})", object)
            extra[path] = Field(default, check, f"option of policy loss {mode}")
    return extra


def _resolves(loss, option: str, value) -> bool:
    try:
        loss.resolve({option: value})
    except ValueError:
        return False
    return True


def _stages(values: Mapping[str, Any], check_data: bool) -> tuple[StageOptions, ...]:
    options = []
    for index, raw in enumerate(values["stages"]):
        if not hasattr(raw, "keys"):
            raise ConfigError(f"config.stages[{index}]={raw!r}: must be a stage (config.stage(...))")
        _unknown_fields(raw, schema_rl.STAGE, f"stages[{index}].")
        stage = _read(raw, schema_rl.STAGE, f"stages[{index}].", check_data)
        options.append(StageOptions(**{name: stage[path] for name, path in config_keys(StageOptions).items()},
                                    max_prompt_length=values["batch.max_prompt_length"],
                                    page_size=DEFAULT_PAGE_SIZE))
    return tuple(options)


def _construct(cls, paths: Mapping[str, str], values: Mapping[str, Any], section: str, **extra):
    """``cls`` of the config fields ``paths`` (argument -> config path) and ``extra`` arguments; what its
    own checks refuse is a ``ConfigError`` naming the config field the message is about."""
    arguments = {name: values[path] for name, path in paths.items()}
    try:
        return cls(**arguments, **extra)
    except ValueError as error:
        named = [n for n in paths if re.search(rf"\b{n}\b", str(error))]
        where = f"{paths[named[0]]}={arguments[named[0]]!r}" if named else section
        raise ConfigError(f"config.{where}: {error}") from None


#: The engine's config keys: ``EngineConfig`` field -> config key (the engine's types state no keys: the
#: engine knows nothing of the run config). Its lengths and page pool follow from the stages.
ENGINE_KEYS = {
    "num_slots": "rollout.engine_slots", "seed": "seed", "quantize_head": "rollout.quantize_head",
    "weight_dtype": "rollout.weight_dtype", "kv_dtype": "rollout.kv_dtype",
    "weight_block": "rollout.weight_block", "fp8_matmul": "rollout.fp8_matmul",
    "attention": "rollout.attention",
}  # fmt: skip
#: ``SamplingParams`` field -> config key.
SAMPLING_KEYS = {"temperature": "rollout.temperature", "top_p": "rollout.top_p", "top_k": "rollout.top_k"}


def _rollout(values, stages: tuple[StageOptions, ...], model: ModelConfig) -> RolloutOptions:
    longest = max(stages, key=lambda s: s.max_response_length)
    kv_tokens = values["rollout.kv_cache_tokens"]
    engine_values = {path: values[path] for path in ENGINE_KEYS.values()}
    for name in ("weight_dtype", "kv_dtype"):
        engine_values[ENGINE_KEYS[name]] = engine_values[ENGINE_KEYS[name]] or None
    engine = _construct(
        EngineConfig, ENGINE_KEYS, engine_values, "rollout",
        max_len=longest.engine_max_len, page_size=longest.page_size,
        # The page pool the memory plan counts (+1: the engine's null page); 0: enough for every slot.
        num_pages=kv_tokens // longest.page_size + 1 if kv_tokens else None,
    )
    if engine.weight_dtype == FP8:  # what the engine would refuse when built: now, naming the field
        try:
            check_weight_blocks(model, engine.weight_block, engine.quantize_head)
        except ValueError as error:
            raise ConfigError(f"config.rollout.weight_block={engine.weight_block}: {error}") from None
    sampling = _construct(SamplingParams, SAMPLING_KEYS, values, "rollout")
    return _section(RolloutOptions, values, engine=engine, sampling=sampling,
                    reward_fn=_reward_fn(values["reward.fn"]))


def _reward_fn(spec: str) -> str:
    """``reward.fn`` once it imports as a function (its workers import it again)."""
    if spec:
        module, _, name = spec.partition(":")
        try:
            function = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as error:
            raise ConfigError(f"config.reward.fn={spec!r}: {error}") from None
        if not callable(function):
            raise ConfigError(f"config.reward.fn={spec!r}: not a function")
    return spec


def _estimator(spec: str) -> str:
    """The ``algo.ADVANTAGE_ESTIMATORS`` name of ``rl.estimator``: a registered name as it is; a
    ``module:function`` imported (which may register it) and, when it is not registered, registered under
    ``spec``."""
    if spec in algo.ADVANTAGE_ESTIMATORS:
        return spec
    module, _, name = spec.partition(":")
    try:
        function = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        raise ConfigError(f"config.rl.estimator={spec!r}: {error}") from None
    known = [key for key, estimator in algo.ADVANTAGE_ESTIMATORS.items() if estimator is function]
    if known:
        return known[0]
    algo.register_estimator(spec, function)
    return spec


def _with_tools(policy: PolicyOptions, specs) -> PolicyOptions:
    """``policy`` whose prompt lists the schemas of ``rollout.tools`` (what the run trains and exports)."""
    from rstar2jax.agent.tools import load_tools  # noqa: PLC0415  (an RL run's only)

    try:
        _, prompt = load_tools(tuple(specs), None, policy.prompt)
    except (ValueError, TypeError) as error:
        raise ConfigError(f"config.rollout.tools={tuple(specs)!r}: {error}") from None
    return dataclasses.replace(policy, prompt=prompt)


def _rl_loop(values, stages: tuple[StageOptions, ...], row_multiple: int,
             model: ModelConfig) -> RLLoopOptions:
    iterations = tuple(
        _construct(RLIterationConfig, config_keys(RLIterationConfig), values, "rl",
                   seq_len=s.seq_len, pack=values["batch.pack"], row_multiple=row_multiple)
        for s in stages
    )
    loss_keys = config_keys(RLLossConfig)
    # The registered policy losses' own options (loss.<option> fields RLLossConfig lacks) are bound by name,
    # not by ``key``: a loss registered by the user's module brings its fields with it.
    loss_options = tuple((path.removeprefix("loss."), values[path]) for path in values
                         if path.startswith("loss.") and path not in loss_keys.values()
                         and path != "loss.allow_uncorrected_mismatch")
    correction = off_policy_correction(values["rl.off_policy_correction"], values["rl.schedule"],
                                       values["rl.max_staleness"])
    return _section(
        RLLoopOptions, values,
        num_rows=None if values["batch.pack"] else values["rl.prompts_per_step"] * values["rl.keep"],
        iterations=iterations,
        loss=_construct(RLLossConfig, loss_keys, values, "loss", off_policy_correction=correction,
                        options=loss_options),
        rollout=_rollout(values, stages, model),
    )


def _data(values) -> DataOptions:
    data = {name: values[path] for name, path in config_keys(DataOptions).items()}
    data.update({k: v or None for k, v in data.items() if k.endswith("_field")})  # '' -> the loader's guess
    return DataOptions(**data)


def _section(cls, values, **extra) -> Any:
    """``cls`` of its fields' config keys (:func:`config_keys`) and ``extra``, the fields built otherwise."""
    return cls(**{name: values[path] for name, path in config_keys(cls).items()}, **extra)


def _distributed(values) -> DistributedOptions:
    distributed = _section(DistributedOptions, values)
    if distributed.num_processes == schema_rl.AUTO:
        return dataclasses.replace(distributed, num_processes=None)  # None: the cluster's environment says
    return distributed


def _logging(values) -> LoggingOptions:
    wandb = _section(WandbOptions, values)
    wandb = dataclasses.replace(wandb, tags=tuple(wandb.tags))
    return _section(LoggingOptions, values, wandb=wandb)


def parse(config, kind: str | None = None, *, check_data: bool = True) -> RunOptions:
    """The :class:`RunOptions` of a run config, checked field by field as it is read; raises
    :class:`ConfigError` naming the first bad field (its full path, value and what is allowed).

    ``kind``: "rl" or "sft" (None: "rl" when the config has an ``rl`` section); a launcher says which it
    trains, so a config of the other kind is an error. ``check_data=False`` (dry runs, and checking a
    recipe's later phase before an earlier one writes its data): the problem set and SFT data files need not
    exist yet; the model, tokenizer and adapter folders always must.
    """
    if kind is None:
        kind = "rl" if "rl" in config else "sft"
    if kind not in schema.KINDS:
        raise ValueError(f"kind={kind!r}; expected one of {schema.KINDS}")
    if kind not in config:  # the section only a config of this kind has
        wanted, other = ("an RL", "an SFT") if kind == "rl" else ("an SFT", "an RL")
        raise ConfigError(f"config.{kind} is missing: {other} config where {wanted} one is needed (e.g. "
                          "experiments/configs/tiny_cpu.py for RL, tiny_cpu.py:sft for SFT)")
    fields = schema.fields(kind)
    if kind == "rl":
        fields.update(_mode_option_fields(config, fields))
    values = _Values(_read(config, fields, "", check_data))
    _unknown_fields(config, fields)
    stages = _stages(values, check_data) if kind == "rl" else ()
    common_rules(values)
    if kind == "rl":
        values.update(mismatch_correction(values))  # "auto": from the rollout's precision
        values["rl.estimator"] = _estimator(values["rl.estimator"])
        rl_rules(values, stages)
    policy = policy_from_values(values)
    if kind == "rl":  # the engine and the trainer run the policy's model config: both get the numerics
        model = dataclasses.replace(policy.model, numerics=values["rollout.numerics"])
        policy = _with_tools(dataclasses.replace(policy, model=model), values["rollout.tools"])
    mesh = _section(MeshShape, values)
    num_microbatches = values["num_microbatches"]
    sft = _section(SFTOptions, values) if kind == "sft" else None
    rl = None
    if kind == "rl":
        rl = _rl_loop(values, stages, values["rl.mini_batches"] * num_microbatches * mesh.data_parallel,
                      policy.model)
        if policy.model.numerics == "exact":  # the trainer computes through the rollout's precision (FP8)
            model = dataclasses.replace(policy.model, rollout_precision=rl.rollout.engine.rollout_precision)
            policy = dataclasses.replace(policy, model=model)
    optimizer = _section(OptimizerOptions, values,
                         warmup_fraction=values["sft.warmup_fraction"] if kind == "sft" else 0.0)
    options = RunOptions(
        workdir=pathlib.Path(values["workdir"]),
        seed=values["seed"],
        notice=values["notice"],
        policy=policy,
        mesh=mesh,
        distributed=_distributed(values),
        optimizer=optimizer,
        checkpoint=_section(CheckpointOptions, values),
        logging=_logging(values),
        num_microbatches=num_microbatches,
        record=config.to_json_best_effort(indent=1),
        stages=stages,
        data=_data(values) if kind == "rl" else None,
        rl=rl,
        sft=sft,
    )
    if unread := [path for path in fields if path not in values.read]:
        raise RuntimeError(f"parse builds no option from config.{unread[0]}: pass it on where the run reads "
                           "it")
    return options
