"""Export a policy as a plain Hugging Face folder, for transformers, vLLM, SGLang or any other stack.

  python -m experiments.export --model=runs/my_rl_run --output=exported/rl        # a training run folder
  python -m experiments.export --model=BASE --adapter=LORA_DIR --output=exported/merged   # base + adapter

``--model`` is a training run folder (SFT or RL: its latest checkpoint, or ``--step``; a LoRA run's adapters
merged into its base, after checking the base is the one they were trained on) or an HF base folder (or hub
name) with ``--adapter``, a PEFT LoRA folder merged into it as peft's ``merge_and_unload()`` merges:
``W + s·A·B`` per adapted projection (``s = lora_alpha / r``, ``/ sqrt(r)`` with rsLoRA), computed in float32.
Loading is the serving launchers' own (``rstar2jax.serve.load_policy``), so what is exported is what
``evaluate`` / ``chat`` / ``serve`` run.

``--output`` receives ``config.json``, the weights as safetensors (sharded with an index when large), the
tokenizer with its chat template, the base's ``generation_config.json`` when it has one, and the
conversation format the policy was trained in (``rstar2jax_prompt.json``, when the run or base records one).
The folder is written beside ``--output`` and renamed into place; an existing non-empty ``--output`` is
refused unless ``--overwrite``. A missing or mismatched input (no such folder, an adapter of another
architecture or shapes, a peft option this library cannot apply, ``--adapter`` with a run folder) is one line
and exit 2.
"""

from __future__ import annotations

import json
import pathlib
import shutil

from absl import flags

from experiments import _launch, _policy_flags

_MODEL = flags.DEFINE_string("model", None, "Training run folder, or HF base folder / hub name (--adapter).")
_ADAPTER = _policy_flags.define_adapter_flags()
_OUTPUT = flags.DEFINE_string("output", None, "Folder to write the HF model to.")
_TOKENIZER = flags.DEFINE_string("tokenizer", None, "Tokenizer folder (default: the model's or the run's).")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step of a run folder (default: the latest).",
                             lower_bound=0)
_DTYPE = flags.DEFINE_enum(
    "dtype", "auto", ["auto", "float32", "bfloat16"],
    "Stored weight dtype; auto: a local HF folder's own (its config.json), else float32 (a run folder, a hub "
    "name).",
)
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace an existing non-empty --output folder.")
flags.mark_flags_as_required(["model", "output"])
_STORED_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float32"}  # config.json -> ours


def _dtype(model: pathlib.Path) -> str:
    """``--dtype``, with ``auto`` resolved: the dtype an HF folder records (float16 widened to float32: this
    library computes in float32 or bfloat16), else float32."""
    if _DTYPE.value != "auto":
        return _DTYPE.value
    try:
        recorded = json.loads((model / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):  # a run folder, a hub name: the loader says what is wrong with it
        return "float32"
    return _STORED_DTYPES.get(recorded.get("torch_dtype") or recorded.get("dtype"), "float32")


def _check_output(output: pathlib.Path, inputs: list[pathlib.Path]) -> None:
    """One line and exit 2 for an output that is an input or holds one (replacing it would delete the input),
    or a non-empty folder to keep."""
    for given in inputs:
        if given.exists() and (output == given or output in given.parents):
            _launch.fail(f"--output={_OUTPUT.value}: that is, or holds, the input {given}")
    if output.exists() and not output.is_dir():
        _launch.fail(f"--output={_OUTPUT.value}: a file is there, not a folder")
    if output.is_dir() and any(output.iterdir()) and not _OVERWRITE.value:
        _launch.fail(f"--output={_OUTPUT.value}: the folder exists and is not empty (--overwrite replaces "
                     "it)")


def main(argv):
    del argv
    model = pathlib.Path(_MODEL.value).expanduser()
    output = pathlib.Path(_OUTPUT.value).expanduser().resolve()
    inputs = [p.resolve() for p in (model, pathlib.Path(_ADAPTER.value or model).expanduser())]
    _check_output(output, inputs)
    dtype = _dtype(model)
    policy = _policy_flags.load_policy_or_exit(
        _MODEL.value, tokenizer=_TOKENIZER.value, dtype=dtype, adapter=_ADAPTER.value, step=_STEP.value
    )
    from rstar2jax.policy.weights import save_policy

    save_policy(policy.params, policy.model_config, output, tokenizer=policy.tokenizer, prompt=policy.prompt)
    generation = pathlib.Path(policy.path) / "generation_config.json"
    if policy.source == "hf" and generation.is_file():
        shutil.copy2(generation, output / generation.name)
    source = f"run {policy.path}, step {policy.step}" if policy.source == "run" else policy.path
    merged = f" + adapter {policy.adapter} (merged)" if policy.adapter else ""
    recorded = "rstar2jax_prompt.json" if policy.prompt is not None else "no prompt format (none recorded)"
    print(
        f"exported {source}{merged} -> {output}\n"
        f"  {policy.model_config.model_type}, {policy.model_config.num_layers} layers, {dtype} weights, "
        f"tokenizer, {recorded}\n"
        f"  transformers: AutoModelForCausalLM.from_pretrained({str(output)!r}); vLLM: vllm serve {output}",
        flush=True,
    )


if __name__ == "__main__":
    _launch.run(main)
