"""Run configuration (ml_collections): the RL and SFT configs with their defaults, and their stages.

A config file (see ``experiments/configs/``) starts from ``rl_config()`` or ``sft_config()`` and overrides
fields; launchers accept ``--config.a.b=value`` on top, then read it once with ``rstar2jax.config.parse``.
Every field (default, allowed values, meaning) is declared once, in ``rstar2jax.config.schema``; this module
builds the ``ConfigDict`` from it and reads and writes a run's recorded config.
"""

from __future__ import annotations

import json
import pathlib
from typing import TYPE_CHECKING, Any

from rstar2jax.config import schema
from rstar2jax.config.checks import Field

if TYPE_CHECKING:
    import ml_collections

__all__ = ["RUN_CONFIG_FILE", "placeholder", "read_run_config", "rl_config", "sft_config", "stage",
           "write_run_config"]


# ml_collections is imported where a config is built, not with this module: the library's steps, loops and
# colocation import (and its tests run) where the package is missing, e.g. a GPU image without it.
def _config_dict(fields: dict | None = None) -> ml_collections.ConfigDict:
    import ml_collections  # noqa: PLC0415

    return ml_collections.ConfigDict(fields)


def placeholder(field_type: type):
    """``ml_collections.config_dict.placeholder``: a field of that type whose value may be None."""
    import ml_collections  # noqa: PLC0415

    return ml_collections.config_dict.placeholder(field_type)


def _initial(field: Field) -> Any:
    """A field's entry: its default (a nested config for a mapping); a field that may be None is a
    placeholder of the check's type (holding the default), so that overrides parse as that type."""
    if isinstance(field.default, dict):
        return _config_dict(field.default)
    if field.check(None):
        reference = placeholder(field.check.type)
        reference.set(field.default)
        return reference
    return field.default


def _build(fields: dict[str, Field]) -> ml_collections.ConfigDict:
    """The config of ``fields`` (dotted paths) with their defaults, nested in their order."""
    tree: dict[str, Any] = {}
    for path, field in fields.items():
        *parents, leaf = path.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = field

    def convert(node: dict) -> ml_collections.ConfigDict:
        c = _config_dict()
        for key, value in node.items():
            c[key] = convert(value) if isinstance(value, dict) else _initial(value)
        return c

    return convert(tree)


def rl_config() -> ml_collections.ConfigDict:
    """GRPO-RoC defaults (the paper's where it gives them); stages are added by the config file."""
    return _build(schema.fields("rl"))


def sft_config() -> ml_collections.ConfigDict:
    """Non-reasoning SFT defaults (paper: 3 epochs, lr 5e-6, 4% warm-up, cosine, batch 128)."""
    return _build(schema.fields("sft"))


def stage(
    name: str,
    *,
    steps: int,
    max_response_length: int,
    max_turns: int,
    dataset: str = "",
    hard_filter_rollouts: int = 0,
    reset_optimizer: bool = False,
) -> ml_collections.ConfigDict:
    """One RL stage. ``dataset`` empty: the previous stage's problems (the first stage: ``config.data``);
    ``hard_filter_rollouts`` k > 0: at the stage start drop problems the current policy solves k/k."""
    return _config_dict(
        dict(
            name=name,
            steps=steps,
            max_response_length=max_response_length,
            max_turns=max_turns,
            dataset=dataset,
            hard_filter_rollouts=hard_filter_rollouts,
            reset_optimizer=reset_optimizer,
        )
    )


#: The run's config as JSON, in its work folder: what loads the run's checkpoints without the launcher
#: (``rstar2jax.serve.load_policy`` reads the model and tokenizer from it).
RUN_CONFIG_FILE = "run_config.json"


def write_run_config(workdir: pathlib.Path, config) -> pathlib.Path:
    """Writes ``config`` (an ``ml_collections.ConfigDict``, or its JSON text: ``RunOptions.record``) as
    ``workdir/run_config.json``."""
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / RUN_CONFIG_FILE
    temporary = path.with_suffix(".json.tmp")
    text = config if isinstance(config, str) else config.to_json_best_effort(indent=1)
    temporary.write_text(text, encoding="utf-8")
    temporary.replace(path)
    return path


def read_run_config(workdir: str | pathlib.Path):
    """The run config a run wrote into ``workdir`` (``write_run_config``), as a ``ConfigDict``."""
    return _config_dict(json.loads((pathlib.Path(workdir) / RUN_CONFIG_FILE).read_text(encoding="utf-8")))
