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

from experiments import _launch

FLAGS = _launch.define_training_flags(
    "Config file with get_config('sft'), e.g. experiments/configs/tiny_cpu.py:sft; --print_config lists "
    "its fields.",
    step="SFT",
    max_steps_help="Stop after this many steps (default: the whole run).",
)


def main(argv):
    del argv
    from rstar2jax import train  # no JAX backend starts on import
    from rstar2jax.policy.adapters import adapter_folder

    options = _launch.prologue(FLAGS.config.value, kind="sft", title="sft", dry_run=FLAGS.dry_run.value,
                               print_fields=FLAGS.print_config.value)
    if options is None:
        return
    policy = train.RunPaths.of(options.workdir).policy
    with _launch.stop_on_signals() as stop:
        train.train_sft(options, max_steps=FLAGS.max_steps.value, export_dir=policy, stop=stop)
    print(
        f"policy (HF folder with the tokenizer): {policy}\n"
        f"  RL from it: python -m experiments.train_rl --config=<an RL config> --config.model.path={policy}",
        flush=True,
    )
    if options.lora is not None:
        print(f"LoRA adapter alone (PEFT folder): {adapter_folder(policy)}", flush=True)


if __name__ == "__main__":
    _launch.run(main)
