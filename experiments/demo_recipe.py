"""The whole rStar2-Agent recipe at toy scale, as resumable phases: task -> SFT data -> tokenizer -> SFT ->
policy export -> held-out evaluation -> GRPO-RoC stages -> evaluation -> report.

Each phase writes its output under one work folder and is skipped when that output is already there; SFT
and RL resume from their own checkpoints. The launchers (``experiments/demo.py``,
``experiments/ablate_roc.py``) only wire these together, so a notebook can run, inspect or replace any
single phase. The phases' run configs and where they write are data, in ``experiments/configs/demo.py``; the
library parts: parsing a run config (``rstar2jax.config.parse``), export (``rstar2jax.policy.export``), the
rollout function (``rstar2jax.train.rollouts``), loading (``rstar2jax.policy.loader``) and evaluation, the
paper's protocol (``rstar2jax.eval.evaluate.evaluate_policy``, the evaluate launcher's module too).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import pathlib
import shutil
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import ml_collections

from experiments.configs.demo import MODEL_PRESET, DemoPaths, before_files, sft_run_config
from rstar2jax import models, train
from rstar2jax.config.parse_model import prompt_from_config
from rstar2jax.data.chat_template import render_chat
from rstar2jax.data.conversation import max_prompt_tokens
from rstar2jax.data.problems import Problem, load_problems
from rstar2jax.data.sft_data import build_sft_examples, sft_rows
from rstar2jax.data.synthetic import SyntheticTask, make_task
from rstar2jax.data.tokenizer import load_tokenizer, train_tiny_tokenizer
from rstar2jax.data.tool_result import format_tool_result
from rstar2jax.eval.evaluate import evaluate_policy, save_evaluation
from rstar2jax.policy.loader import load_policy
from rstar2jax.schedules.schedule import RolloutFn
from rstar2jax.train.run import StopSignal

#: Metrics an evaluation reports, in the order the report lists them.
EVAL_KEYS = (
    "pass@1",
    "tool_error_ratio",
    "tool_error_ratio_correct",
    "tool_calls_per_traj",
    "response_length",
    "truncation_rate",
)


def _write_jsonl(path: pathlib.Path, rows: Sequence[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(path.suffix + ".tmp")
    with temporary.open("w", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    temporary.replace(path)  # a crash mid-write never leaves a half file that a re-run would trust


def write_task(config: ml_collections.ConfigDict, paths: DemoPaths) -> SyntheticTask:
    """Generates the synthetic task (deterministic in ``config.seed``) and writes both splits as JSONL."""
    t = config.task
    task = make_task(
        t.num_train, t.num_eval, seed=config.seed, families=tuple(t.families), difficulty=t.difficulty
    )
    for path, split in ((paths.train_problems, task.train), (paths.eval_problems, task.eval)):
        _write_jsonl(
            path, [{"id": p.id, "problem": p.problem, "answer": p.answer, "family": p.family} for p in split]
        )
    return task


def load_split(path: str | pathlib.Path) -> list[Problem]:
    """Problems of a split written by :func:`write_task`."""
    loaded = load_problems(path)
    if loaded.num_skipped or not loaded.problems:
        raise ValueError(
            f"{path}: expected usable problems, got {len(loaded)} and skips {dict(loaded.skipped)}"
        )
    return loaded.problems


def write_sft_data(
    config: ml_collections.ConfigDict,
    task: SyntheticTask,
    run_code: Callable[[str, str], Any],
    paths: DemoPaths,
    *,
    progress: bool = True,
) -> dict[str, int]:
    """Tool-use conversations for the first ``sft_data.num_examples`` train problems, every call run by
    ``run_code(code, stdin)`` (the sandbox); returns the count per injected bug kind ("none": clean)."""
    d, prompt = config.sft_data, prompt_from_config(config)
    if d.num_examples > len(task.train):
        raise ValueError(f"sft_data.num_examples={d.num_examples} > task.num_train={len(task.train)}")
    examples = build_sft_examples(
        task.train[: d.num_examples],
        run_code,
        format_tool_output=functools.partial(
            format_tool_result, max_chars=config.rl.rollout.tool_output_chars
        ),
        prompt=prompt,
        fail_rate=d.fail_rate,
        bug_kinds=tuple(d.bug_kinds),
        seed=config.seed,
        max_workers=4,
        progress=progress,
    )
    _write_jsonl(paths.sft_data, sft_rows(examples, prompt))
    counts: dict[str, int] = {}
    for e in examples:
        counts[e.bug_kind or "none"] = counts.get(e.bug_kind or "none", 0) + 1
    return counts


def train_tokenizer(config: ml_collections.ConfigDict, paths: DemoPaths):
    """A byte-level BPE tokenizer (ChatML + Hermes tool tags) trained on the rendered SFT conversations, with
    numbers in groups of ``config.tokenizer_digit_group`` digits, each group one token: a number then reads
    the same in the problem, the code, the tool output and the answer, so a tiny model copies it in a few
    lookups."""
    rows = [json.loads(line) for line in paths.sft_data.read_text(encoding="utf-8").splitlines() if line]
    # Rendering needs a tokenizer that carries the template: a throwaway bytes-only one renders.
    scratch = paths.workdir / "tokenizer.bytes"
    renderer = train_tiny_tokenizer([""], 259, scratch)
    texts = [render_chat(renderer, r["messages"], tools=r["tools"]) for r in rows]
    shutil.rmtree(scratch)
    return train_tiny_tokenizer(
        texts,
        config.tokenizer_vocab_size,
        paths.tokenizer,
        digit_group=config.tokenizer_digit_group,
    )


def write_model_config(config: ml_collections.ConfigDict, paths: DemoPaths, tokenizer) -> models.ModelConfig:
    """The demo model (``MODEL_PRESET`` refined by ``config.model``) with the vocabulary and end-of-turn token
    of the demo's ``tokenizer``, written as an HF ``config.json`` at ``paths.model_config`` (what the SFT
    phase's ``model.config_json`` names)."""
    model = models.preset(
        MODEL_PRESET,
        **config.model.to_dict(),
        vocab_size=len(tokenizer),
        eos_token_ids=(tokenizer.convert_tokens_to_ids(tokenizer.eos_token),),
    )
    paths.model_config.parent.mkdir(parents=True, exist_ok=True)
    temporary = paths.model_config.with_suffix(".json.tmp")
    temporary.write_text(json.dumps(models.config_to_hf(model), indent=1), encoding="utf-8")
    temporary.replace(paths.model_config)
    return model


def check_run_configs(
    config: ml_collections.ConfigDict, *runs: ml_collections.ConfigDict
) -> list[train.RunOptions]:
    """Parses the phases' run configs (``configs.demo.sft_run_config`` / ``rl_run_config``) before the demo
    writes their files (``configs.demo.before_files``), so a bad value fails now, in one line, not when its
    phase starts; returns their options."""
    return [train.parse(before_files(run, config), check_data=False) for run in runs]


def check_backend(checked: list[train.RunOptions]) -> None:
    """What this backend must run for the phases (``check_run_configs``' options): an FP8 rollout's float8
    support, a ConfigError naming the field before any work (``train.check_rollout_precision``). Sets the
    process up first (the emulated devices of the largest mesh), as a JAX backend may start here."""
    train.prepare_process(max(checked, key=lambda options: options.mesh.size))
    for options in checked:
        train.check_rollout_precision(options)


def check_prompt_budget(config: ml_collections.ConfigDict, paths: DemoPaths) -> int:
    """Raises when a train or held-out prompt is longer than ``rl.batch.max_prompt_length``."""
    tokenizer = load_tokenizer(paths.tokenizer)
    problems = load_split(paths.train_problems) + load_split(paths.eval_problems)
    longest = max_prompt_tokens(tokenizer, problems, prompt_from_config(config))
    if longest > config.rl.batch.max_prompt_length:
        raise ValueError(
            f"the longest prompt has {longest} tokens > rl.batch.max_prompt_length="
            f"{config.rl.batch.max_prompt_length}; raise it or the tokenizer's vocabulary"
        )
    return longest


def _cell(value: Any) -> str:
    """A metric for a markdown table ("–" when missing or NaN, e.g. no tool call in correct trajectories)."""
    return "–" if value is None or value != value else f"{value:.3f}"


def write_demo_report(
    paths: DemoPaths,
    before: dict[str, Any],
    after: dict[str, Any],
    *,
    timings: dict[str, float] | None = None,
) -> pathlib.Path:
    """The RL run's report (accuracy, tool-error ratio inside correct trajectories and response length over
    steps, from ``eval.report.write_report``) plus the held-out evaluation before and after RL, the SFT loss
    curve and the phase timings; returns the markdown's path."""
    from rstar2jax.eval import report

    path = report.write_report(paths.rl_run / "metrics.jsonl", paths.report, title="rstar2jax CPU demo")
    sft_plot = report.PlotSpec("sft_loss.png", "SFT loss", "masked cross-entropy", ("loss",))
    report.plot_curves(
        report.read_metrics(paths.sft_run / "metrics.jsonl"), sft_plot, paths.report / "sft_loss.png"
    )
    lines = [
        "",
        "## Held-out evaluation (average pass@1 over samples, same sampling as RL)",
        "",
        "| metric | after SFT | after RL |",
        "|---|---|---|",
    ]
    for key in EVAL_KEYS:
        cells = [_cell(r["metrics"].get(key)) for r in (before, after)]
        lines.append(f"| {key} | {cells[0]} | {cells[1]} |")
    lines += ["", "## SFT", "", "![SFT loss](sft_loss.png)", ""]
    if timings:
        lines += ["## Phase timings (this invocation)", "", "| phase | seconds |", "|---|---|"]
        lines += [f"| {name} | {seconds:.1f} |" for name, seconds in timings.items()]
    with path.open("a", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return path


class PhaseTimer:
    """Wall-clock seconds per phase, announced (with where the phase writes) and printed as they finish."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.start = time.perf_counter()

    @contextlib.contextmanager
    def phase(self, name: str, where: pathlib.Path | None = None):
        print(f"\n== {name}" + (f"  ->  {where}" if where else ""), flush=True)
        start = time.perf_counter()
        yield
        self.seconds[name] = time.perf_counter() - start
        print(f"   {name}: {self.seconds[name]:.1f}s", flush=True)

    def total(self) -> float:
        return time.perf_counter() - self.start


def prepare_policy(
    config: ml_collections.ConfigDict,
    paths: DemoPaths,
    sandbox_url: str,
    timer: PhaseTimer,
    *,
    stop: StopSignal | None = None,
) -> train.RunOptions:
    """Task, SFT data (tool calls run on the sandbox at ``sandbox_url``), tokenizer and the model's
    ``config.json``, SFT and its export to ``paths.sft_policy``; each phase skipped when its output exists
    (``stop``: stops SFT after a step). Returns the SFT run's options."""
    from rstar2jax.agent.sandbox_client import SyncSandboxClient

    with timer.phase("task", paths.train_problems.parent):
        task = write_task(config, paths)
        print(
            f"   {len(task.train)} train / {len(task.eval)} held-out problems, {list(config.task.families)}"
        )
    if not paths.sft_data.exists():
        with (
            timer.phase("sft data (real tool calls)", paths.sft_data),
            SyncSandboxClient(sandbox_url) as client,
        ):
            counts = write_sft_data(
                config, task, lambda code, stdin: dataclasses.asdict(client.run(code, stdin)), paths
            )
            print(f"   conversations per first-call bug: {counts}")
    if not (paths.tokenizer / "tokenizer.json").exists():
        with timer.phase("tokenizer", paths.tokenizer):
            print(f"   vocabulary {len(train_tokenizer(config, paths))}")
    if not paths.model_config.exists():
        write_model_config(config, paths, load_tokenizer(paths.tokenizer))
    longest = check_prompt_budget(config, paths)
    sft = train.parse(sft_run_config(config, paths))
    train.prepare_process(sft)  # before the first JAX computation
    if not (paths.sft_policy / "config.json").exists():
        with timer.phase("sft", paths.sft_run):
            m = sft.model
            print(f"   model {m.num_layers} layers x {m.hidden_size}, vocabulary {m.vocab_size}, "
                  f"longest prompt {longest} tokens")
            train.train_sft(sft, export_dir=paths.sft_policy, stop=stop)
    return sft


def evaluate_saved(
    config: ml_collections.ConfigDict,
    path: pathlib.Path,
    policy_dir: pathlib.Path,
    problems_path: pathlib.Path,
    rollout_fn: RolloutFn,
    timer: PhaseTimer,
) -> dict[str, Any]:
    """Held-out evaluation (``config.eval``) of an exported policy, saved to ``path`` (skipped when it
    exists); returns the saved record."""
    if not path.exists():
        with timer.phase(f"eval {policy_dir.name}", path):
            params = load_policy(policy_dir).params
            e = config.eval
            result = evaluate_policy(
                params,
                load_split(problems_path),
                rollout_fn,
                samples=e.samples,
                max_response_length=e.max_response_length,
                max_turns=e.max_turns,
                seed=config.seed + 1,
            )
            save_evaluation(result, path, policy=str(policy_dir), samples=e.samples)
    record = json.loads(path.read_text(encoding="utf-8"))
    print(
        f"   held-out, {policy_dir.name}: "
        + ", ".join(f"{k}={record['metrics'][k]:.3f}" for k in EVAL_KEYS if k in record["metrics"])
    )
    return record


def configure_compile_cache(directory: str) -> None:
    """A persistent JAX compilation cache in ``directory`` ('' leaves it off): re-runs and the ablation's
    runs reuse the programs the first run compiled."""
    if directory:
        jax.config.update("jax_compilation_cache_dir", str(pathlib.Path(directory).resolve()))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
