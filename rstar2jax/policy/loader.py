"""The one way a trained policy is loaded: an HF model folder (or hub name) or a training run folder, into a
:class:`Policy` (model config, parameters, tokenizer, the conversation format it was trained in).

Both forms go through the loaders training uses, so what is evaluated, chatted with or served is what was
trained:

* an HF folder (``config.json`` + safetensors, as ``save_pretrained`` and the SFT export write them) is read
  by :func:`rstar2jax.models.load_pretrained`; its tokenizer comes from the same folder unless given;
* a training run folder, the ``workdir`` of ``experiments.train_rl`` / ``experiments.sft``, holds the run's
  config (``run_config.json``) and its orbax checkpoints: the model config is built from the run config as
  the trainer builds it, the parameters are those of the latest (or a chosen) checkpoint
  (:func:`restore_run_params`, also what ``train.policy.export_policy`` writes out), and the tokenizer is the
  one the run used (``config.tokenizer``, else ``config.model.path``'s). A checkpoint folder inside it
  (``<workdir>/checkpoints`` or ``<workdir>/checkpoints/<step>``) works too. A LoRA run's checkpoints hold
  its adapters: they are merged into the run's base (``config.model``), after checking it is the base they
  were trained on.

An HF base folder with ``adapter=`` a PEFT LoRA folder (``adapter_config.json`` +
``adapter_model.safetensors``, as a LoRA run exports and PEFT saves) loads the base with the adapters merged
in. ``rstar2jax.serve.load_policy`` is this module's :func:`load_policy`.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rstar2jax import models
from rstar2jax.config.config import RUN_CONFIG_FILE, read_run_config
from rstar2jax.config.options import PolicyOptions
from rstar2jax.config.parse_model import policy_options
from rstar2jax.data.conversation import PromptConfig, load_prompt_config
from rstar2jax.policy import adapters as lora_lib
from rstar2jax.policy.weights import CHECKPOINT_DIR, initial_params


@dataclasses.dataclass
class Policy:
    """A loaded policy: model config, parameters (layer-stacked, as the trainer holds them) and tokenizer.

    ``name`` is what the server reports as the model id (the folder's name); ``source`` says where it came
    from (``"hf"`` or ``"run"``, with the checkpoint ``step`` for a run). ``prompt`` is the conversation
    format it was trained in (None: a plain HF folder, which records none).
    """

    model_config: models.ModelConfig
    params: Any
    tokenizer: Any
    name: str
    path: str
    source: str
    step: int | None = None
    prompt: PromptConfig | None = None
    adapter: str | None = None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The model's EOS ids plus the tokenizer's end-of-turn token (``<|im_end|>`` for ChatML): a turn
        ends at either."""
        ids = list(self.model_config.eos_token_ids or ())
        eos = self.tokenizer.eos_token
        if eos:
            eos_id = self.tokenizer.convert_tokens_to_ids(eos)
            if isinstance(eos_id, int) and eos_id not in ids:
                ids.append(eos_id)
        return tuple(ids)


def _step_folders(checkpoints: pathlib.Path) -> dict[int, pathlib.Path]:
    """Finished step folders of an orbax checkpoint folder (temporary ones of an interrupted save have a
    non-numeric name and are left out)."""
    return {
        int(p.name): p
        for p in checkpoints.iterdir()
        if p.is_dir() and p.name.isdigit() and (p / "state").is_dir()
    }


def restore_state_params(state_dir: pathlib.Path):
    """The ``params`` subtree of a saved ``TrainState`` as host NumPy arrays (no optimizer or mesh needed:
    a run trained on many devices loads on one); a LoRA run's are its adapters."""
    import orbax.checkpoint as ocp

    state_dir = pathlib.Path(state_dir).resolve()  # orbax finds no item metadata under a relative path
    checkpointer = ocp.PyTreeCheckpointer()
    tree = checkpointer.metadata(state_dir).item_metadata.tree
    if "params" not in tree:
        raise ValueError(f"{state_dir} holds no 'params': it is not a training-state checkpoint")
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    return checkpointer.restore(state_dir, args=ocp.args.PyTreeRestore(restore_args=restore_args))["params"]


def _restore_meta(step_dir: pathlib.Path) -> dict:
    """The JSON record saved beside a checkpoint's state (``Checkpointer.save``'s ``meta``)."""
    import orbax.checkpoint as ocp

    return ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(pathlib.Path(step_dir).resolve() / "meta")


def _locate_run(path: pathlib.Path, step: int | None) -> tuple[pathlib.Path, pathlib.Path, int] | None:
    """``(workdir, step folder, step)`` when ``path`` is a run folder, its checkpoints folder or one of its
    step folders; None otherwise."""
    if path.name.isdigit() and path.parent.name == CHECKPOINT_DIR:
        if step is not None and step != int(path.name):
            raise ValueError(f"step={step} was given with the step folder {path}")
        workdir, step = path.parent.parent, int(path.name)
    else:
        workdir = path.parent if path.name == CHECKPOINT_DIR else path
    if not ((workdir / RUN_CONFIG_FILE).is_file() and (workdir / CHECKPOINT_DIR).is_dir()):
        return None
    steps = _step_folders(workdir / CHECKPOINT_DIR)
    if not steps:
        raise FileNotFoundError(f"{workdir / CHECKPOINT_DIR} holds no finished checkpoint")
    chosen = max(steps) if step is None else step
    if chosen not in steps:
        raise FileNotFoundError(f"{workdir}: no checkpoint for step {chosen}; saved steps: {sorted(steps)}")
    return workdir, steps[chosen], chosen


@dataclasses.dataclass(frozen=True)
class RunParams:
    """What a run checkpoint holds of the policy: ``params`` to sample with (a LoRA run's base with its
    ``adapters`` merged in; ``adapters`` and ``lora`` None for a full fine-tuning run)."""

    model_config: models.ModelConfig
    params: Any
    adapters: Any = None
    lora: models.LoraConfig | None = None


def restore_run_params(policy: PolicyOptions, step_dir: pathlib.Path) -> RunParams:
    """The policy parameters of the run checkpoint ``step_dir`` (``policy``: the run's, ``policy_options``
    of its config; a LoRA run's base checked against the checkpoint's record of it before its adapters are
    merged in)."""
    model_config, lora = policy.model, policy.lora
    saved = restore_state_params(step_dir / "state")
    if lora is None:
        params = jax.tree.map(lambda x: jnp.asarray(x, model_config.param_dtype), saved)
        return RunParams(model_config, params)
    base = initial_params(policy.source, model_config, None)
    expected = lora_lib.base_record(policy.source, lora, base)
    lora_lib.check_base(_restore_meta(step_dir).get(lora_lib.META_KEY), expected, str(step_dir))
    merged = models.lora.merge(base, saved, lora, model_config.param_dtype)
    return RunParams(model_config, merged, adapters=saved, lora=lora)


def latest_run_params(policy: PolicyOptions, workdir: pathlib.Path) -> RunParams | None:
    """:func:`restore_run_params` of the latest checkpoint of the run in ``workdir``; None when it has
    none."""
    checkpoints = pathlib.Path(workdir) / CHECKPOINT_DIR
    steps = _step_folders(checkpoints) if checkpoints.is_dir() else {}
    return restore_run_params(policy, steps[max(steps)]) if steps else None


def _is_hub_name(name: str) -> bool:
    return name.count("/") == 1 and not name.startswith((".", "/", "~")) and all(name.split("/"))


def load_policy(
    model: str | os.PathLike,
    *,
    tokenizer: str | os.PathLike | None = None,
    step: int | None = None,
    dtype: str = "float32",
    adapter: str | os.PathLike | None = None,
    strict_base: bool = False,
) -> Policy:
    """Loads a policy from an HF folder, a hub name or a training run folder (see the module docstring).

    Args:
      model: the folder (or a hub name, fetched with ``huggingface_hub`` into its cache).
      tokenizer: a tokenizer folder to use instead of the model's own.
      step: for a run folder, the checkpoint step (default: the latest).
      dtype: parameter and compute dtype (``"float32"`` or ``"bfloat16"``).
      adapter: a PEFT LoRA folder to merge into the HF base ``model``.
      strict_base: refuse an adapter whose ``base_model_name_or_path`` names another model than ``model``
        (by default that only warns: the architecture and the tensors' shapes decide).

    Raises:
      FileNotFoundError / ValueError naming what is missing or does not fit: no config, no weights, no
      tokenizer, no checkpoint, a tokenizer without a chat template, an adapter for another architecture or
      shapes, or with a peft option this library cannot apply.
    """
    path = pathlib.Path(os.fspath(model)).expanduser()
    if not path.exists():
        if not _is_hub_name(os.fspath(model)):
            raise FileNotFoundError(
                f"model {os.fspath(model)!r}: no such folder (and not a hub name org/model)"
            )
        from huggingface_hub import snapshot_download

        path = pathlib.Path(snapshot_download(os.fspath(model)))
    run = _locate_run(path.resolve(), step)
    if run is not None:
        if adapter is not None:
            raise ValueError(
                f"adapter={os.fspath(adapter)!r} was given with the training run folder {run[0]} (a LoRA "
                "run's checkpoints hold its adapters); pass the HF base folder as model"
            )
        policy = _load_run(path, *run, tokenizer=tokenizer, dtype=dtype)
    else:
        if step is not None:
            raise ValueError(f"step={step} was given but {path} is not a training run folder")
        policy = _load_hf(path, model, tokenizer=tokenizer, dtype=dtype, adapter=adapter,
                          strict_base=strict_base)
    return policy


def _chat_tokenizer(path):
    """The tokenizer at ``path``; one without a chat template is an error."""
    from rstar2jax.data.tokenizer import load_tokenizer  # transformers: once the folder is known to be there

    tokenizer = load_tokenizer(path)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the tokenizer at {path} has no chat template; pass a tokenizer that has one")
    return tokenizer


def _load_run(path: pathlib.Path, workdir: pathlib.Path, step_dir: pathlib.Path, step: int, *, tokenizer,
              dtype: str) -> Policy:
    policy = policy_options(read_run_config(workdir))
    policy = dataclasses.replace(
        policy, model=dataclasses.replace(policy.model, param_dtype=dtype, compute_dtype=dtype)
    )
    tokenizer_path = tokenizer or policy.tokenizer
    if not tokenizer_path:
        raise ValueError(f"{workdir / RUN_CONFIG_FILE} names no tokenizer; pass tokenizer=")
    restored = restore_run_params(policy, step_dir)
    return Policy(restored.model_config, restored.params, _chat_tokenizer(tokenizer_path), workdir.name,
                  str(path), "run", step, policy.prompt)


def _load_hf(path: pathlib.Path, model, *, tokenizer, dtype: str, adapter, strict_base: bool) -> Policy:
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{path} is neither an HF model folder (no config.json) nor a training run folder "
            f"(no {RUN_CONFIG_FILE} beside a {CHECKPOINT_DIR}/ folder)"
        )
    if adapter is not None:  # checked against the base's config before its weights are read
        lora, adapters = models.peft_adapter.load_peft_adapter(
            adapter, models.config_from_hf(path), base_model=os.fspath(model), strict_base=strict_base
        )
    model_config, params = models.load_pretrained(path, dtype=dtype)
    name = path.name
    if adapter is not None:
        params = models.lora.merge(params, adapters, lora, model_config.param_dtype)
        name, adapter = pathlib.Path(os.fspath(adapter)).name, str(adapter)
    return Policy(model_config, params, _chat_tokenizer(tokenizer or path), name, str(path), "hf", None,
                  load_prompt_config(path), adapter)
