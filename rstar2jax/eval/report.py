"""Run reports from a metrics JSONL: PNG curves, a markdown summary, and the RoC-vs-GRPO ablation plot.

The JSONL holds one JSON object per logged step (``step``, optionally ``stage``, and any metrics). Every
key is optional: a plot shows the series that are present, a missing series is noted in the report, and
non-numeric or non-finite values are skipped. Plots use matplotlib's object API (no pyplot, no global
backend switch), so they render headless and leave an interactive session's backend alone.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import math
import os
import pathlib
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from matplotlib.figure import Figure

Record = Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class PlotSpec:
    """One curve plot: the metric names it shows are those matching any of ``keys`` (``fnmatch`` patterns)."""

    filename: str
    title: str
    ylabel: str
    keys: tuple[str, ...]


DEFAULT_PLOTS = (
    PlotSpec(
        "accuracy.png", "Accuracy", "accuracy", ("accuracy", "eval_accuracy", "eval*accuracy", "eval*pass@1")
    ),
    PlotSpec(
        "tool_error_ratio_correct.png",
        "Tool-error ratio inside correct trajectories",
        "failed / all tool calls",
        ("tool_error_ratio_correct", "eval*tool_error_ratio_correct"),
    ),
    PlotSpec(
        "response_length.png",
        "Response length",
        "tokens",
        ("response_len_mean", "response_length", "eval*response_len_mean", "eval*response_length"),
    ),
)


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a metrics JSONL (blank lines skipped; a cut-off last line, as left by a crash, is
    skipped with a warning; any other malformed line is an error naming it)."""
    lines = pathlib.Path(path).read_text(encoding="utf-8").splitlines()
    numbered = [(number, line) for number, line in enumerate(lines, 1) if line.strip()]
    records = []
    for position, (number, line) in enumerate(numbered):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if position == len(numbered) - 1:
                warnings.warn(f"{path}:{number}: skipping a truncated last line ({e.msg})", stacklevel=2)
                break
            raise ValueError(f"{path}:{number}: not valid JSON ({e.msg})") from e
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
        records.append(record)
    return records


def _number(value: Any) -> float | None:
    """A finite float from a JSON value, or None (bools, strings, nulls, NaN and infinities are not data)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def series(records: Sequence[Record], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of ``key``, sorted by step; the last record wins on repeated steps.

    A record without ``step`` counts as step = its index in ``records``.
    """
    by_step: dict[float, float] = {}
    for index, record in enumerate(records):
        value, step = _number(record.get(key)), _number(record.get("step", index))
        if value is not None and step is not None:
            by_step[step] = value
    steps = np.array(sorted(by_step), dtype=np.float64)
    return steps, np.array([by_step[s] for s in steps], dtype=np.float64)


def matching_keys(records: Sequence[Record], patterns: Sequence[str]) -> list[str]:
    """Metric names with at least one numeric value that match any pattern, in pattern order."""
    present = {key for record in records for key, value in record.items() if _number(value) is not None}
    present.discard("step")
    keys: list[str] = []
    for pattern in patterns:
        keys += sorted(k for k in present if fnmatch.fnmatchcase(k, pattern) and k not in keys)
    return keys


def _stages(records: Sequence[Record]) -> list[tuple[Any, list[Record]]]:
    """Consecutive runs of records with the same ``stage`` (records without one join the current run)."""
    runs: list[tuple[Any, list[Record]]] = []
    for record in records:
        stage = record.get("stage", runs[-1][0] if runs else None)
        if not runs or stage != runs[-1][0]:
            runs.append((stage, []))
        runs[-1][1].append(record)
    return runs


def plot_curves(records: Sequence[Record], spec: PlotSpec, path: str | os.PathLike) -> list[str]:
    """Plots every metric matching ``spec`` over steps (stage changes marked) to ``path``.

    Returns the metric names plotted; with none, no file is written.
    """
    keys = matching_keys(records, spec.keys)
    if not keys:
        return []
    figure = Figure(figsize=(7.0, 4.0), layout="constrained")
    axes = figure.add_subplot()
    for key in keys:
        steps, values = series(records, key)
        axes.plot(steps, values, marker="o" if len(steps) <= 30 else None, markersize=3, label=key)
    for position, (stage, stage_records) in enumerate(_stages(records)):
        start = _number(stage_records[0].get("step"))
        if start is None or stage is None:
            continue
        if position:
            axes.axvline(start, color="gray", linestyle="--", linewidth=1)
        axes.annotate(
            f"stage {stage}",
            (start, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(3, -12),
            textcoords="offset points",
            fontsize=8,
            color="gray",
        )
    axes.set(title=spec.title, xlabel="step", ylabel=spec.ylabel)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.savefig(os.fspath(path), dpi=120)
    return keys


def _format(value: float | None) -> str:
    if value is None:
        return "–"
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"


def _summary_table(records: Sequence[Record], keys: Sequence[str]) -> list[str]:
    """Markdown rows: per stage (and the whole run), the step range and each metric's first → last value."""
    rows = [
        "| stage | steps | " + " | ".join(keys) + " |",
        "|---|---|" + "---|" * len(keys),
    ]
    stages = _stages(records)
    sections = [*stages, ("all", list(records))] if len(stages) > 1 else [("all", list(records))]
    for stage, stage_records in sections:
        steps = [s for r in stage_records if (s := _number(r.get("step"))) is not None]
        cells = []
        for key in keys:
            values = series(stage_records, key)[1]
            cells.append(f"{_format(values[0])} → {_format(values[-1])}" if len(values) else "–")
        step_range = f"{_format(min(steps))}–{_format(max(steps))}" if steps else "–"
        rows.append(f"| {stage} | {step_range} | " + " | ".join(cells) + " |")
    return rows


def write_report(
    metrics_path: str | os.PathLike,
    out_dir: str | os.PathLike | None = None,
    *,
    title: str = "rstar2jax run report",
    plots: Sequence[PlotSpec] = DEFAULT_PLOTS,
) -> pathlib.Path:
    """Writes the plots and ``report.md`` (plots embedded, summary table) for one run.

    Args:
      metrics_path: the run's metrics JSONL.
      out_dir: where to write (default: the JSONL's folder); created if needed.
      title: the report's heading.
      plots: which curves to draw (default: accuracy, tool-error ratio inside correct trajectories,
        response length).

    Returns:
      The path of ``report.md``.
    """
    metrics_path = pathlib.Path(metrics_path)
    out = pathlib.Path(out_dir) if out_dir is not None else metrics_path.parent
    out.mkdir(parents=True, exist_ok=True)
    # Records without a step are placed by their line order, as ``series`` does.
    records = [{"step": index, **record} for index, record in enumerate(read_metrics(metrics_path))]
    lines = [f"# {title}", "", f"{len(records)} records from `{metrics_path}`.", ""]
    summary_keys: list[str] = []
    for spec in plots:
        lines += [f"## {spec.title}", ""]
        keys = plot_curves(records, spec, out / spec.filename)
        if keys:
            lines.append(f"![{spec.title}]({spec.filename})")
            summary_keys += [k for k in keys if k not in summary_keys]
        else:
            lines.append(f"_No data: the metrics have none of {', '.join(spec.keys)}._")
        lines.append("")
    lines += ["## Summary (first → last value)", "", *_summary_table(records, summary_keys), ""]
    report = out / "report.md"
    report.write_text("\n".join(lines), encoding="utf-8")
    return report


def aggregate_runs(
    runs: Mapping[str, Sequence[Sequence[Record]]], key: str
) -> dict[str, dict[str, list[float]]]:
    """Across the runs (seeds) of each group: per step, the mean, std (population), min, max and run count.

    Args:
      runs: ``{group: [records of run 1, records of run 2, ...]}``, e.g. ``{"roc": [...], "grpo": [...]}``.
      key: the metric.

    Returns:
      ``{group: {"step", "mean", "std", "min", "max", "num_runs"}}`` (lists over the steps any run logged;
      groups without the metric are left out). JSON-ready.
    """
    out = {}
    for group, group_runs in runs.items():
        per_run = [dict(zip(*series(records, key), strict=True)) for records in group_runs]
        steps = sorted({step for run in per_run for step in run})
        if not steps:
            continue
        at_step = [np.array([run[s] for run in per_run if s in run]) for s in steps]
        out[group] = {
            "step": [float(s) for s in steps],
            "mean": [float(v.mean()) for v in at_step],
            "std": [float(v.std()) for v in at_step],
            "min": [float(v.min()) for v in at_step],
            "max": [float(v.max()) for v in at_step],
            "num_runs": [float(len(v)) for v in at_step],
        }
    return out


def plot_ablation(
    runs: Mapping[str, Sequence[Sequence[Record]]],
    path: str | os.PathLike,
    keys: Sequence[str] = ("tool_error_ratio_correct", "accuracy"),
    *,
    spread: str = "std",
    title: str = "GRPO-RoC vs GRPO",
) -> pathlib.Path:
    """One panel per metric: each group's mean over its runs, shaded by ``spread`` ("std": mean ± std,
    "minmax": min to max). The paper's Fig. 4 in miniature with ``keys=("tool_error_ratio_correct",)``."""
    if spread not in ("std", "minmax"):
        raise ValueError(f"spread must be 'std' or 'minmax', got {spread!r}")
    if not keys:
        raise ValueError("keys is empty; name at least one metric to plot")
    figure = Figure(figsize=(5.5 * len(keys), 4.0), layout="constrained")
    figure.suptitle(title)
    for index, key in enumerate(keys):
        axes = figure.add_subplot(1, len(keys), index + 1)
        curves = aggregate_runs(runs, key)
        for group, curve in curves.items():
            steps, mean = np.array(curve["step"]), np.array(curve["mean"])
            if spread == "std":
                low, high = mean - np.array(curve["std"]), mean + np.array(curve["std"])
            else:
                low, high = np.array(curve["min"]), np.array(curve["max"])
            (line,) = axes.plot(steps, mean, label=f"{group} (n={len(runs[group])})")
            axes.fill_between(steps, low, high, color=line.get_color(), alpha=0.2, linewidth=0)
        if not curves:
            axes.text(0.5, 0.5, "no data", transform=axes.transAxes, ha="center", va="center", color="gray")
        else:
            axes.legend(fontsize=8)
        shade = "± std" if spread == "std" else "min–max"
        axes.set(title=f"{key} (mean, {shade})", xlabel="step", ylabel=key)
        axes.grid(alpha=0.3)
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(os.fspath(path), dpi=120)
    return path


def selection_rows(
    selection, group: int, columns: Mapping[str, Sequence[Any]]
) -> list[dict[str, Any]]:
    """One row per rollout of ``group`` in an ``algo.roc_select`` result: its index, the ``columns``
    (name -> that group's per-rollout values, e.g. reward, p_err, p_format, p_total) and ``kept``
    (True when RoC kept it). The notebooks' table of kept and dropped trajectories."""
    indices = np.asarray(selection.indices[group])
    kept = set(indices[np.asarray(selection.mask[group])].tolist())
    sizes = {name: len(values) for name, values in columns.items()}
    if len(set(sizes.values())) > 1:
        raise ValueError(f"selection_rows: columns differ in length: {sizes}")
    size = next(iter(sizes.values()), 0)
    return [
        {"rollout": i, **{name: values[i] for name, values in columns.items()}, "kept": i in kept}
        for i in range(size)
    ]


def html_table(rows: Sequence[Mapping[str, Any]], *, dim: str = "kept") -> str:
    """``rows`` (dicts with the same keys) as an HTML table; rows whose ``dim`` column is False are greyed
    (dropped rollouts). Floats print with 3 decimals."""
    if not rows:
        return "<p>(no rows)</p>"
    keys = list(rows[0])
    cell = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)  # noqa: E731
    head = "".join(f"<th>{k}</th>" for k in keys)
    body = "".join(
        "<tr style='color:#999'>" * (dim in row and not row[dim])
        + "<tr>" * (dim not in row or bool(row[dim]))
        + "".join(f"<td>{cell(row[k])}</td>" for k in keys)
        + "</tr>"
        for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
