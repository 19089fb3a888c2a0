"""GRPO-RoC training: the staged rStar2-Agent recipe (rollouts with the Python tool, RoC, policy update).

  python -m experiments.train_rl --config=experiments/configs/tiny_cpu.py --config.workdir=runs/tiny
  python -m experiments.train_rl --config=experiments/configs/paper_qwen3_14b.py --dry_run
  python -m experiments.train_rl --config=experiments/configs/demo.py:rl --config.workdir=runs/demo_rl2
  python -m experiments.train_rl --config=experiments/configs/tiny_cpu.py --print_config  # fields, meanings

Any config field can be overridden: --config.rl.keep=8 --config.stages[0].steps=10 --config.mesh.fsdp=8.
A run resumes from the latest checkpoint in its workdir; Ctrl-C saves a checkpoint and stops; a bad config
value exits 2 naming the field. A sandbox that stops answering is waited for (rollout.sandbox_outage_s) and,
when the run started it, restarted; a fault the run cannot ride out (the sandbox gone past that budget,
rl.max_nonfinite_steps non-finite steps in a row, a failed checkpoint write) exits 3 with one line, keeping
the last finished step's checkpoint, so the same command resumes. --dry_run compiles the update step for the
configured mesh on abstract shapes (emulating CPU devices when the host has fewer) and prints per-device
memory.
"""

from __future__ import annotations

import contextlib

from experiments import _launch

FLAGS = _launch.define_training_flags(
    "RL config file (experiments/configs/*.py) with get_config(); --print_config lists its fields.",
    step="RL",
    max_steps_help="Stop after this many RL steps in total (default: all).",
)


def agent_rollout_fn(options, stack: contextlib.ExitStack):
    """The real rollout: the generation engine on the trainer's parameters (no copies on one host; its
    model, engine and sampling from ``options``, the trainer's own ``RunOptions``), the sandbox at
    ``rollout.sandbox_url`` (or a local one started for the run, restarted if it dies) and the answer
    verifier."""
    from rstar2jax.train.rollouts import policy_rollout

    url, restart = options.rl.rollout.sandbox_url, None
    if not url:
        from sandbox_server import start_local

        server = stack.enter_context(start_local(workers=options.rl.rollout.sandbox_workers))
        url, restart = server.url, server.restart_if_dead
    rollout_fn = policy_rollout(options, url, options.policy.prompt, restart_sandbox=restart)
    stack.callback(rollout_fn.close)
    return rollout_fn


def main(argv):
    del argv
    from rstar2jax import train  # no JAX backend starts on import

    options = _launch.prologue(
        FLAGS.config.value, kind="rl", title="rl", dry_run=FLAGS.dry_run.value,
        print_fields=FLAGS.print_config.value,
    )
    if options is None:
        return
    with contextlib.ExitStack() as stack:
        rollout_fn = agent_rollout_fn(options, stack)
        stop = stack.enter_context(_launch.stop_on_signals())
        train.train_rl(options, rollout_fn=rollout_fn, max_steps=FLAGS.max_steps.value, stop=stop)


if __name__ == "__main__":
    _launch.run(main)
