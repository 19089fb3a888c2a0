"""RoC vs plain GRPO from the same SFT policy (the paper's Fig. 4 in miniature); full-parameter RL vs LoRA.

The demo's SFT policy (made first if ``--demo_workdir`` has none) is trained by the demo's RL recipe once per
seed and arm (``--modes``): with Resample-on-Correct (``paper``: 2G rollouts, correct ones down-sampled by
fewest tool errors / format issues, incorrect ones uniformly), with plain GRPO (``uniform``: 2G -> G uniformly
at random), with RoC training LoRA adapters instead of all weights (``lora``: the demo config's ``lora``
rank, alpha and learning rate), with RoC sampling in FP8 (``fp8``: the engine's weights in 64 x 64 blocks
and its KV pages in float8, the trainer in the demo's float32, token-level TIS on as it is by default then),
or with RoC on the asynchronous schedule (``async``: ``rl.schedule="async"``, eta = 1, the decoupled
loss). An arm may change run-config fields of its base arm: ``BASE+section.field=value[+...]`` (values read as
Python literals, else text), e.g. ``paper+loss.mode=cispo`` or ``paper+rl.ppo_epochs=2``; every arm's config
is checked before the first run starts. Every arm's final policy is evaluated by an engine in the trainer's
precision. Writes, under --workdir:

  ablation.png     tool-error ratio inside correct trajectories, accuracy and response length over steps
                   (mean +- std over seeds)
  ablation.json    the same curves per mode (mean / std / min / max per step), and the sampler-vs-trainer
                   log-prob mismatch per step (mismatch_*), each run's final held-out evaluation, and the
                   per-run metrics files

  python -m experiments.ablate_roc                      # 3 seeds x 2 modes
  python -m experiments.ablate_roc --seeds=0 --config.rl.stages[0].steps=4
  python -m experiments.ablate_roc --modes=paper,lora --workdir=runs/ablate_lora   # full vs LoRA
  python -m experiments.ablate_roc --modes=paper,fp8 --workdir=runs/ablate_fp8     # float32 vs FP8 rollout
  python -m experiments.ablate_roc --modes=paper,async --workdir=runs/ablate_async # sync vs async (eta=1)
  python -m experiments.ablate_roc --modes=paper+rl.ppo_epochs=2,paper+rl.ppo_epochs=2+loss.mode=cispo \
      --workdir=runs/ablate_loss                       # the clipped surrogate vs CISPO, 2 updates per batch

Runs resume: a finished run (its exported policy exists) is skipped, an interrupted one continues.
"""

from __future__ import annotations

import ast
import contextlib
import json
import pathlib
import time
from collections.abc import Sequence

import ml_collections
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
_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "RL seeds (each runs every arm).")
_MODES = flags.DEFINE_list("modes", ["paper", "uniform"],
                           "Arms: paper, uniform, lora (RoC training LoRA), fp8 (RoC, FP8 rollout + TIS), "
                           "async (RoC, asynchronous); ARM+section.field=value[+...] changes run-config "
                           "fields of an arm (e.g. paper+loss.mode=cispo, paper+rl.ppo_epochs=2).")
_EVAL = flags.DEFINE_bool("eval", True, "Evaluate every run's final policy on the held-out split.")
_COMPILE_CACHE = flags.DEFINE_string("compile_cache", "runs/jax_cache", "Persistent JAX compilation cache.")
_PRINT_CONFIG = flags.DEFINE_bool("print_config", False, _launch.PRINT_CONFIG_HELP)

#: What the ablation compares over steps (names logged by the RL iteration).
CURVES = ("tool_error_ratio_correct", "accuracy", "response_length")
#: The sampler-vs-trainer log-prob mismatch every RL step logs (``train.rl_step``), in the summary's curves.
MISMATCH_CURVES = ("mismatch_abs_log_ratio", "mismatch_k3_kl", "mismatch_outside_band")
LABELS = {"paper": "GRPO-RoC", "uniform": "GRPO", "lora": "GRPO-RoC + LoRA", "fp8": "GRPO-RoC, FP8 rollout",
          "async": "GRPO-RoC, asynchronous"}
#: Arm -> (roc_mode, LoRA adapters instead of all weights).
ARMS = {"paper": ("paper", False), "uniform": ("uniform", False), "lora": ("paper", True),
        "fp8": ("paper", False), "async": ("paper", False)}
#: Arms whose RL run config changes more than that: run-config field -> value. FP8: the demo model's
#: projections are 128 x 64 .. 384 x 128, so 64 x 64 blocks (the largest edge dividing them all); the loss
#: defaults then give token-level TIS at C = 2 on recomputed log-probs. Asynchronous: eta = 1, the decoupled
#: objective ("auto"), the engine colocated with the trainer.
ARM_FIELDS = {"fp8": {"rollout.weight_dtype": "fp8", "rollout.kv_dtype": "fp8", "rollout.weight_block": 64},
              "async": {"rl.schedule": "async", "rl.max_staleness": 1, "rl.off_policy_correction": "auto"}}


def parse_arm(spec: str) -> tuple[str, dict]:
    """``BASE[+section.field=value...]`` -> (BASE, {"section.field": value}): an arm of ``ARMS`` and the
    run-config fields it changes (values as Python literals, else text); a ``ConfigError`` in one line."""
    from rstar2jax.train import ConfigError

    base, *changes = spec.split("+")
    if base not in ARMS:
        raise ConfigError(f"--modes: {spec!r}: {base!r} is not an arm; expected any of {tuple(ARMS)}, each "
                          "optionally followed by +section.field=value")
    fields = {}
    for change in changes:
        path, equals, text = change.partition("=")
        if not equals or path.count(".") != 1 or not all(path.split(".")):
            raise ConfigError(f"--modes: {spec!r}: {change!r} is not section.field=value")
        try:
            fields[path] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            fields[path] = text
    return base, fields


def arm_run_config(config, paths, mode: str, **run):
    """The RL run config of arm ``mode`` (``configs.demo.rl_run_config`` with the base arm's ``ARMS`` and
    ``ARM_FIELDS``, then the fields ``mode`` changes, :func:`parse_arm`; ``run``: its workdir and seed)."""
    from experiments.configs.demo import rl_run_config
    from rstar2jax.train import ConfigError

    base, changes = parse_arm(mode)
    roc_mode, lora = ARMS[base]
    c = rl_run_config(config, paths, roc_mode=roc_mode, lora=lora, **run)
    for path, value in {**ARM_FIELDS.get(base, {}), **changes}.items():
        section, field = path.split(".")
        if section not in c:
            raise ConfigError(f"--modes: {mode!r}: config.{section} is no section of the RL run config")
        c[section][field] = value
    return c


#: The rollout fields of a low-precision engine (``config.rollout.<name>``), reset to their defaults (the
#: trainer's precision) for the final evaluation.
PRECISION_FIELDS = ("weight_dtype", "kv_dtype", "weight_block", "quantize_head", "fp8_matmul")


def trainer_precision(run_config):
    """``run_config`` with its rollout in the trainer's precision (``PRECISION_FIELDS`` at their defaults):
    what evaluates every arm's final policy, so each held-out figure comes from the same evaluator."""
    from rstar2jax.config.schema_rl import RL

    c = ml_collections.ConfigDict(run_config.to_dict())
    for name in PRECISION_FIELDS:
        c.rollout[name] = RL[f"rollout.{name}"].default
    return c


def _rollout_fn(options, server, stack: contextlib.ExitStack):
    """The run's rollout function (closed with ``stack``) on the ablation's sandbox."""
    from rstar2jax.train.rollouts import policy_rollout

    rollout_fn = policy_rollout(options, server.url, options.policy.prompt,
                                restart_sandbox=server.restart_if_dead)
    stack.callback(rollout_fn.close)
    return rollout_fn


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
    from experiments.configs.demo import DemoPaths, sft_run_config
    from rstar2jax import train
    from rstar2jax.eval import report
    from rstar2jax.policy.export import export_policy
    from sandbox_server import start_local

    paths = DemoPaths(config.workdir)
    arms = [arm_run_config(config, paths, m) for m in modes]
    # Every run's config is checked before the first starts.
    checked = recipe.check_run_configs(config, sft_run_config(config, paths), *arms)
    recipe.configure_compile_cache(compile_cache)
    recipe.check_backend(checked)
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    names = [f"{mode}-seed{seed}" for seed in seeds for mode in modes]
    _launch.announce(
        "RoC ablation", out, runs={"sft": paths.sft_run, **{n: out / n for n in names}}, options=checked[-1]
    )
    timer = recipe.PhaseTimer()
    runs: dict[str, list[list[dict]]] = {LABELS.get(m, m): [] for m in modes}
    evaluations: dict[str, list[dict]] = {LABELS.get(m, m): [] for m in modes}
    metrics_files: dict[str, list[str]] = {LABELS.get(m, m): [] for m in modes}
    with contextlib.ExitStack() as stack:
        stop = stack.enter_context(_launch.stop_on_signals())
        server = stack.enter_context(start_local(workers=config.sandbox_workers))
        recipe.prepare_policy(config, paths, server.url, timer, stop=stop)
        for seed in seeds:
            for mode in modes:
                name, label = f"{mode}-seed{seed}", LABELS.get(mode, mode)
                run_config = arm_run_config(config, paths, mode, workdir=out / name, seed=seed)
                rl = train.parse(run_config)
                policy = out / name / "policy"
                rollout_fn = _rollout_fn(rl, server, stack)
                if not (policy / "config.json").exists():
                    with timer.phase(f"rl {name}", out / name):
                        train.train_rl(rl, rollout_fn=rollout_fn, stop=stop)
                        export_policy(rl, policy)
                metrics_path = out / name / "metrics.jsonl"
                runs[label].append(report.read_metrics(metrics_path))
                metrics_files[label].append(str(metrics_path))
                if evaluate:
                    evaluator = rollout_fn
                    if (plain := trainer_precision(run_config)).rollout != run_config.rollout:
                        evaluator = _rollout_fn(train.parse(plain), server, stack)
                    evaluation = recipe.evaluate_saved(
                        config, out / name / "eval.json", policy, paths.eval_problems, evaluator, timer
                    )
                    evaluations[label].append({"seed": seed, **evaluation["metrics"]})
    plot = report.plot_ablation(
        runs, out / "ablation.png", keys=CURVES, title=f"{' vs '.join(runs)} (same SFT policy)"
    )
    summary = {
        "curves": {key: report.aggregate_runs(runs, key) for key in CURVES + MISMATCH_CURVES},
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
    config = _launch.demo_config(_CONFIG.value, _DEMO_WORKDIR.value, _PRINT_CONFIG.value)
    if config is None:
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
