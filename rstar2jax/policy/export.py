"""A run's policy out of the run: its latest checkpoint written as a Hugging Face folder
(:func:`export_policy`, what ``config.model.path``, ``models.load_pretrained``, transformers and vLLM read)
and the run's tokenizer (:func:`run_tokenizer`).

Loading a policy (an HF folder or a run folder) is ``policy.loader.load_policy``; the trainer's rollout
function built from a run's options is ``train.rollouts.policy_rollout``; evaluating a policy is
``rstar2jax.eval.evaluate``. The staged demo recipe that wires these together lives in
``experiments/demo_recipe.py``.
"""

from __future__ import annotations

import pathlib

from rstar2jax.config.options import RunOptions
from rstar2jax.data.tokenizer import load_tokenizer
from rstar2jax.policy import adapters as lora_lib
from rstar2jax.policy import loader
from rstar2jax.policy.weights import save_policy


def run_tokenizer(options: RunOptions):
    """The run's tokenizer (``config.tokenizer``, else the one in ``config.model.path``), or None."""
    path = options.policy.tokenizer
    return load_tokenizer(path) if path else None


def export_policy(options: RunOptions, out: pathlib.Path) -> pathlib.Path:
    """Writes the latest checkpoint's parameters of a run (its ``RunOptions``;
    restored as ``load_policy`` restores them, ``loader.latest_run_params``) as a HF folder (config.json,
    safetensors, the run's tokenizer with its chat template and the run's conversation format), the form
    ``config.model.path`` and ``load_pretrained`` read. A LoRA run's policy is its base with the adapters
    merged in, and its adapters alone are written beside it as a PEFT folder
    (``policy.adapters.adapter_folder(out)``)."""
    restored = loader.latest_run_params(options.policy, options.workdir)
    if restored is None:
        raise FileNotFoundError(f"{options.workdir}: no checkpoint to export")
    out = save_policy(restored.params, restored.model_config, out, tokenizer=run_tokenizer(options),
                      prompt=options.policy.prompt)
    if restored.lora is not None:
        source = options.policy.source
        lora_lib.save_adapter(restored.adapters, source, restored.model_config, restored.lora, out)
    return out
