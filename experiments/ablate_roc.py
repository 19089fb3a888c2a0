"""RoC vs plain GRPO from the same SFT policy (the paper's Fig. 4 in miniature).

The demo's SFT policy (made first if ``--demo_workdir`` has none) is trained by the demo's RL recipe twice per
seed: with Resample-on-Correct (``roc_mode=paper``: 2G rollouts, correct ones down-sampled by fewest tool
errors / format issues, incorrect ones uniformly) and with plain GRPO (``roc_mode=uniform``: 2G -> G uniformly
at random). Writes, under --workdir:

  ablation.png     tool-error ratio inside correct trajectories, accuracy and response length over steps
                   (mean +- std over seeds)
  ablation.json    the same curves per mode (mean / std / min / max per step), each run's final held-out
                   evaluation, and the per-run metrics files

  python -m experiments.ablate_roc                      # 3 seeds x 2 modes
  python -m experiments.ablate_roc --seeds=0 --config.rl.stages[0].steps=4

Runs resume: a finished run (its exported policy exists) is skipped, an interrupted one continues.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import time
from collections.abc import Sequence

from absl import flags

from experiments import _launch

_CONFIG = _launch.define_config(
    "experiments/configs/demo.py",
    "Demo config (the RL recipe and the SFT policy's recipe); --print_config lists its fields.",
    lock_config=False,
)
_DEMO_WORKDIR = flags.DEFINE_string(
    "demo_workdir", None, "Where the SFT policy is (default: config.workdir)."
)
_WORKDIR = flags.DEFINE_string("workdir", "runs/ablate_roc", "Where the ablation's runs and results go.")
_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "RL seeds (each runs both modes).")
_MODES = flags.DEFINE_list("modes", ["paper", "uniform"], "roc_mode values to compare.")
_EVAL = flags.DEFINE_bool("eval", True, "Evaluate every run's final policy on the held-out split.")
_COMPILE_CACHE = flags.DEFINE_string("compile_cache", "runs/jax_cache", "Persistent JAX compilation cache.")
_PRINT_CONFIG = flags.DEFINE_bool("print_config", False, _launch.PRINT_CONFIG_HELP)

#: What the ablation compares over steps (names logged by the RL iteration).
CURVES = ("tool_error_ratio_correct", "accuracy", "response_length")
LABELS = {"paper": "GRPO-RoC", "uniform": "GRPO"}


def run_ablation(
    config,
    out: str | pathlib.Path,
    *,
    seeds: Sequence[int] = (0, 1, 2),
    modes: Sequence[str] = ("paper", "uniform"),
    evaluate: bool = True,
    compile_cache: str = "",
) -> dict:
    """Trains the demo's RL recipe (``config``: the demo config) from its SFT policy once per (seed, mode),
    writes ``ablation.png`` and ``ablation.json`` under ``out`` and returns that summary (also used by
    ``notebooks/roc_ablation.ipynb``). The SFT policy is made first when ``config.workdir`` has none; finished
    runs are skipped, interrupted ones resume."""
    from experiments import demo_recipe as recipe
    from rstar2jax import train
    from rstar2jax.eval import report
    from rstar2jax.train import policy as policy_lib
    from sandbox_server import start_local

    paths = recipe.DemoPaths(config.workdir)
    train.validate(recipe.sft_run_config(config, paths), "sft", check_paths=False)
    for mode in modes:  # every run's config is checked before the first starts
        train.validate(recipe.rl_run_config(config, paths, roc_mode=mode), "rl", check_paths=False)
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    names = [f"{mode}-seed{seed}" for seed in seeds for mode in modes]
    _launch.announce(
        "RoC ablation", out, runs={"sft": paths.sft_run, **{n: out / n for n in names}}, config=config.rl
    )
    recipe.configure_compile_cache(compile_cache)
    timer = recipe.PhaseTimer()
    runs: dict[str, list[list[dict]]] = {LABELS.get(m, m): [] for m in modes}
    evaluations: dict[str, list[dict]] = {LABELS.get(m, m): [] for m in modes}
    metrics_files: dict[str, list[str]] = {LABELS.get(m, m): [] for m in modes}
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(start_local(workers=config.sandbox_workers))
        recipe.prepare_policy(config, paths, server.url, timer)
        prompt = policy_lib.prompt_from_config(config)
        for seed in seeds:
            for mode in modes:
                name, label = f"{mode}-seed{seed}", LABELS.get(mode, mode)
                rl_config = recipe.rl_run_config(
                    config, paths, workdir=out / name, seed=seed, roc_mode=mode
                )
                policy = out / name / "policy"
                rollout_fn = policy_lib.policy_rollout(
                    rl_config, server.url, prompt, restart_sandbox=server.restart_if_dead
                )
                stack.callback(rollout_fn.close)
                if not (policy / "config.json").exists():
                    with timer.phase(f"rl {name}", out / name):
                        train.train_rl(rl_config, rollout_fn=rollout_fn)
                        policy_lib.export_policy(rl_config, policy)
                metrics_path = out / name / "metrics.jsonl"
                runs[label].append(report.read_metrics(metrics_path))
                metrics_files[label].append(str(metrics_path))
                if evaluate:
                    evaluation = recipe.evaluate_saved(
                        config, out / name / "eval.json", policy, paths.eval_problems, rollout_fn, timer
                    )
                    evaluations[label].append({"seed": seed, **evaluation["metrics"]})
    plot = report.plot_ablation(
        runs, out / "ablation.png", keys=CURVES, title="GRPO-RoC vs GRPO (same SFT policy)"
    )
    summary = {
        "curves": {key: report.aggregate_runs(runs, key) for key in CURVES},
        "final_eval": evaluations,
        "metrics_files": metrics_files,
        "seeds": [int(s) for s in seeds],
        "seconds": timer.total(),
    }
    (out / "ablation.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
    for label in runs:
        last = [r[-1] for r in runs[label] if r]
        line = ", ".join(
            f"{key}={sum(r.get(key, float('nan')) for r in last) / max(len(last), 1):.3f}" for key in CURVES
        )
        held_out = [e["pass@1"] for e in evaluations[label]]
        if held_out:
            line += f", held-out pass@1={sum(held_out) / len(held_out):.3f}"
        print(f"{label}: last step (mean over seeds) {line}")
    print(
        f"plot: {plot}\nsummary: {out / 'ablation.json'}\n{time.strftime('%H:%M:%S')}, {timer.total():.0f}s"
    )
    return summary


def main(argv):
    del argv
    config = _CONFIG.value
    if _DEMO_WORKDIR.value:
        config.workdir = _DEMO_WORKDIR.value
    if _PRINT_CONFIG.value:
        from experiments.configs.demo import FIELD_HELP

        _launch.print_config(config, FIELD_HELP)
        return
    run_ablation(
        config,
        _WORKDIR.value,
        seeds=[int(s) for s in _SEEDS.value],
        modes=_MODES.value,
        evaluate=_EVAL.value,
        compile_cache=_COMPILE_CACHE.value,
    )


if __name__ == "__main__":
    _launch.run(main)
