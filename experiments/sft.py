"""Non-reasoning SFT (the stage before RL): masked cross-entropy on assistant tokens over packed sequences.

  python -m experiments.sft --config=experiments/configs/tiny_cpu.py:sft   # the shipped tool-use data
  python -m experiments.sft --config=experiments/configs/tiny_cpu.py:sft --config.sft.data=my_chats.parquet
  python -m experiments.sft --config=experiments/configs/paper_qwen3_14b.py:sft --dry_run
  python -m experiments.sft --config=experiments/configs/demo.py:sft --config.workdir=runs/demo_sft2
  python -m experiments.sft --config=experiments/configs/tiny_cpu.py:sft --print_config  # fields, meanings

Data (.jsonl, .json, .parquet): chats ({"messages": [...], "tools": [...]}, assistant "tool_calls", "tool"
turns as function-calling sets ship them, rendered with config.tokenizer's chat template, loss on the
assistant's tokens only) or pre-tokenised {"input_ids": [...], "loss_mask": [...]}. Any config field can be
overridden (--config.sft.epochs=1 --config.mesh.fsdp=8). A run resumes from the latest checkpoint in its
workdir; Ctrl-C saves a checkpoint and stops; a bad config value exits 2 naming the field.

At the end the policy is exported as an HF folder (safetensors, config.json, the tokenizer with its chat
template) to <workdir>/policy; RL starts from it with
  python -m experiments.train_rl --config=experiments/configs/tiny_cpu.py --config.model.path=<workdir>/policy
"""

from __future__ import annotations

from absl import flags

from experiments import _launch

_CONFIG = _launch.define_config(
    None,
    "Config file with get_config('sft'), e.g. experiments/configs/tiny_cpu.py:sft; --print_config lists "
    "its fields.",
    lock_config=True,
)
_DRY_RUN = flags.DEFINE_bool(
    "dry_run", False, "Compile the SFT step for the configured mesh, print per-device memory, exit."
)
_MAX_STEPS = flags.DEFINE_integer("max_steps", None, "Stop after this many steps (default: the whole run).")
_PRINT_CONFIG = flags.DEFINE_bool("print_config", False, _launch.PRINT_CONFIG_HELP)
flags.mark_flag_as_required("config")


def main(argv):
    del argv
    from rstar2jax import train  # no JAX backend starts on import

    options = _launch.prologue(
        _CONFIG.value, kind="sft", title="sft", dry_run=_DRY_RUN.value, print_fields=_PRINT_CONFIG.value
    )
    if options is None:
        return
    policy = train.RunPaths.of(options.workdir).policy
    with _launch.stop_on_signals() as stop:
        train.train_sft(options, max_steps=_MAX_STEPS.value, export_dir=policy, stop=stop)
    print(
        f"policy (HF folder with the tokenizer): {policy}\n"
        f"  RL from it: python -m experiments.train_rl --config=<an RL config> --config.model.path={policy}",
        flush=True,
    )
    if options.lora is not None:
        print(f"LoRA adapter alone (PEFT folder): {train.lora.adapter_folder(policy)}", flush=True)


if __name__ == "__main__":
    _launch.run(main)
