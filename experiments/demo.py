"""The whole rStar2-Agent recipe on a laptop CPU in about ten minutes, nothing downloaded:

  1. start a local code sandbox;
  2. generate a synthetic integer task (modular powers, gcd / lcm, counting, digit sums) and a held-out split;
  3. write non-reasoning SFT conversations in the paper's tool-use format, every tool call run for real, a
     share of them failing first (NameError, SyntaxError, ...) and fixed on the next call;
  4. train a small BPE tokenizer and SFT a tiny Qwen3-shaped model on them (to a moderate accuracy, on
     purpose);
  5. evaluate it on the held-out split (average pass@1 over k samples, tool-error ratios);
  6. run GRPO-RoC (2G rollouts -> RoC keeps G) in two stages, the second with a longer response budget and
     more turns;
  7. evaluate again and write a report (markdown + PNG curves) beside the metrics JSONL and TensorBoard logs.

  python -m experiments.demo                       # runs/demo
  python -m experiments.demo --workdir=runs/demo2 --config.rl.rl.roc_mode=uniform

Re-running continues where the last run stopped: finished phases are skipped, SFT and RL resume from their
checkpoints. --fresh deletes the work folder first.
"""

from __future__ import annotations

import contextlib
import shutil

from absl import flags

from experiments import _launch

_CONFIG = _launch.define_config(
    "experiments/configs/demo.py",
    "Demo config (experiments/configs/demo.py); --print_config lists its fields.",
    lock_config=False,
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Work folder (default: config.workdir, runs/demo).")
_FRESH = flags.DEFINE_bool("fresh", False, "Delete the work folder first instead of resuming.")
_COMPILE_CACHE = flags.DEFINE_string(
    "compile_cache",
    "runs/jax_cache",
    "Persistent JAX compilation cache ('' to disable): re-runs start faster.",
)
_PRINT_CONFIG = flags.DEFINE_bool("print_config", False, _launch.PRINT_CONFIG_HELP)


def main(argv):
    del argv
    config = _launch.demo_config(_CONFIG.value, _WORKDIR.value, _PRINT_CONFIG.value)
    if config is None:
        return
    from experiments import demo_recipe as recipe
    from experiments.configs.demo import DemoPaths, rl_run_config, sft_run_config
    from rstar2jax import train
    from rstar2jax.policy.export import export_policy
    from rstar2jax.train.rollouts import policy_rollout
    from sandbox_server import start_local

    paths = DemoPaths(config.workdir)
    # Both phases' configs are checked now, not when RL starts after SFT (their files come later).
    phases = sft_run_config(config, paths), rl_run_config(config, paths)
    checked = recipe.check_run_configs(config, *phases)
    rl_checked = checked[-1]
    recipe.configure_compile_cache(_COMPILE_CACHE.value)
    recipe.check_backend(checked)
    if _FRESH.value:
        shutil.rmtree(paths.workdir, ignore_errors=True)
    paths.workdir.mkdir(parents=True, exist_ok=True)
    timer = recipe.PhaseTimer()
    _launch.announce("rstar2jax demo", paths.workdir, runs={"sft": paths.sft_run, "rl": paths.rl_run},
                     options=rl_checked)
    with contextlib.ExitStack() as stack:
        stop = stack.enter_context(_launch.stop_on_signals())
        with timer.phase("sandbox"):
            server = stack.enter_context(start_local(workers=config.sandbox_workers))
            print(f"   {server.url}")
        recipe.prepare_policy(config, paths, server.url, timer, stop=stop)
        rl = train.parse(rl_run_config(config, paths))
        rollout_fn = policy_rollout(rl, server.url, rl.policy.prompt,
                                    restart_sandbox=server.restart_if_dead)
        stack.callback(rollout_fn.close)
        before = recipe.evaluate_saved(
            config, paths.evaluation("sft"), paths.sft_policy, paths.eval_problems, rollout_fn, timer
        )
        if not (paths.rl_policy / "config.json").exists():
            with timer.phase("rl (GRPO-RoC)", paths.rl_run):
                train.train_rl(rl, rollout_fn=rollout_fn, stop=stop)
                export_policy(rl, paths.rl_policy)
        after = recipe.evaluate_saved(
            config, paths.evaluation("rl"), paths.rl_policy, paths.eval_problems, rollout_fn, timer
        )
    with timer.phase("report", paths.report):
        report = recipe.write_demo_report(paths, before, after, timings=timer.seconds)
    gain = after["metrics"]["pass@1"] - before["metrics"]["pass@1"]
    print(
        f"\nheld-out pass@1: {before['metrics']['pass@1']:.3f} after SFT -> {after['metrics']['pass@1']:.3f} "
        f"after RL ({gain * 100:+.1f} points)"
    )
    print(f"this invocation: {timer.total():.0f}s")
    print(
        f"report:  {report}\nmetrics: {paths.rl_run / 'metrics.jsonl'}  "
        f"(SFT: {paths.sft_run / 'metrics.jsonl'})"
    )
    print(f"tensorboard --logdir {paths.workdir}")


if __name__ == "__main__":
    _launch.run(main)
