"""Run report and ablation plot from synthetic metrics JSONL (with missing keys, NaNs and a cut-off line)."""

import json
import math

import jax
import numpy as np
import pytest
from matplotlib.image import imread

from rstar2jax import algo
from rstar2jax.eval.report import (
    DEFAULT_PLOTS,
    aggregate_runs,
    html_table,
    plot_ablation,
    read_metrics,
    selection_rows,
    series,
    write_report,
)


def _records():
    records = []
    for step in range(30):
        record = {
            "step": step,
            "stage": 1 if step < 20 else 2,
            "accuracy": 0.2 + 0.02 * step,
            "tool_error_ratio_correct": 0.4 * math.exp(-step / 10),
            "response_length": 100 + step,
        }
        if step % 5 == 0:
            record["eval/heldout/pass@1"] = 0.1 + 0.02 * step
        if step == 3:
            del record["accuracy"]
            record["response_length"] = float("nan")
            record["tool_error_ratio_correct"] = None
        records.append(record)
    return records


def _assert_real_png(path):
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = imread(path)
    assert pixels.shape[0] > 200 and pixels.shape[1] > 300
    assert pixels[..., :3].std() > 0.05  # not a blank canvas


def test_report_from_metrics_jsonl(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    path.parent.mkdir()
    path.write_text("".join(json.dumps(r) + "\n" for r in _records()) + "\n" + '{"step": 30, "accur')
    with pytest.warns(UserWarning, match="truncated last line"):
        report = write_report(path, tmp_path / "out", title="Demo")
    assert report == tmp_path / "out" / "report.md"
    for spec in DEFAULT_PLOTS:
        _assert_real_png(tmp_path / "out" / spec.filename)
    text = report.read_text()
    assert text.startswith("# Demo") and "30 records" in text
    for spec in DEFAULT_PLOTS:
        assert f"![{spec.title}]({spec.filename})" in text
    table = text[text.index("| stage |") :].splitlines()
    assert table[0] == (
        "| stage | steps | accuracy | eval/heldout/pass@1 | tool_error_ratio_correct | response_length |"
    )
    assert table[2].startswith("| 1 | 0–19 | 0.2 → 0.58 | 0.1 → 0.4 | 0.4 → ")
    assert table[3].startswith("| 2 | 20–29 | 0.6 → 0.78 | 0.5 → 0.6 | ")
    assert table[4].startswith("| all | 0–29 |") and table[4].endswith("| 100 → 129 |")


def test_missing_keys_are_noted_not_fatal(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"reward": 0.5}) + "\n" + json.dumps({"accuracy": 0.25}) + "\n")
    text = write_report(path).read_text()  # no step, no stage, only one of the plotted metrics
    assert "![Accuracy](accuracy.png)" in text and (tmp_path / "accuracy.png").exists()
    assert "_No data: the metrics have none of tool_error_ratio_correct" in text
    assert not (tmp_path / "response_length.png").exists()
    assert "| all | 0–1 | 0.25 → 0.25 |" in text


def test_read_metrics_rejects_a_broken_middle_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"step": \n{"step": 2}\n')
    with pytest.raises(ValueError, match="metrics.jsonl:2: not valid JSON"):
        read_metrics(path)
    path.write_text('{"step": 0}\n[1, 2]\n')
    with pytest.raises(ValueError, match=":2: expected a JSON object"):
        read_metrics(path)


def test_series_skips_non_numbers_and_keeps_the_last_repeat():
    records = [
        {"step": 0, "x": 1},
        {"step": 1, "x": "n/a"},
        {"step": 2, "x": True},
        {"step": 0, "x": 5},
        {"x": 7},
    ]
    steps, values = series(records, "x")
    np.testing.assert_array_equal(steps, [0, 4])  # the record without a step sits at its index
    np.testing.assert_array_equal(values, [5, 7])


def test_ablation_mean_and_spread(tmp_path):
    def run(offset, steps=range(5)):
        return [{"step": s, "tool_error_ratio_correct": offset + 0.1 * s, "accuracy": 0.5} for s in steps]

    runs = {
        "roc": [run(0.0), run(0.2), run(0.4, range(3))],
        "grpo": [run(1.0), run(1.0)],
        "empty": [[{"step": 0}]],
    }
    curves = aggregate_runs(runs, "tool_error_ratio_correct")
    assert set(curves) == {"roc", "grpo"}
    assert curves["roc"]["step"] == [0, 1, 2, 3, 4]
    assert curves["roc"]["num_runs"] == [3, 3, 3, 2, 2]
    np.testing.assert_allclose(curves["roc"]["mean"], [0.2, 0.3, 0.4, 0.4, 0.5])
    np.testing.assert_allclose(curves["roc"]["std"][0], np.std([0.0, 0.2, 0.4]))
    np.testing.assert_allclose(curves["roc"]["max"][4], 0.6)
    assert curves["grpo"]["std"] == [0.0] * 5
    json.dumps(curves)  # ready for the ablation's JSON
    for spread in ("std", "minmax"):
        path = plot_ablation(runs, tmp_path / f"ablation_{spread}.png", spread=spread)
        _assert_real_png(path)
    with pytest.raises(ValueError, match="spread"):
        plot_ablation(runs, tmp_path / "x.png", spread="iqr")


def test_selection_rows_mark_what_roc_kept_and_the_table_greys_the_rest():
    rewards = np.array([[1, 1, 0, 0, 1, 0]], np.float32)
    p_total = np.array([[0.0, 0.9, 0.5, 0.5, 0.0, 1.0]], np.float32)
    selection = algo.roc_select(
        jax.random.key(0), rewards, p_total, np.ones_like(rewards, bool), keep=4, mode="paper"
    )
    rows = selection_rows(selection, 0, {"reward": rewards[0].tolist(), "p_total": p_total[0].tolist()})
    kept = np.asarray(selection.indices[0])[np.asarray(selection.mask[0])]
    assert [r["rollout"] for r in rows] == list(range(6))
    assert sorted(r["rollout"] for r in rows if r["kept"]) == sorted(kept.tolist())
    assert sum(r["kept"] for r in rows) == int(selection.num_kept[0]) == len(kept) > 0
    assert rows[1]["p_total"] == pytest.approx(0.9)
    table = html_table(rows)
    assert table.count("<tr style='color:#999'>") == 6 - len(kept) and table.count("<td>") == 6 * 4
    assert "<th>p_total</th>" in table and "0.900" in table
    with pytest.raises(ValueError, match="differ in length"):
        selection_rows(selection, 0, {"reward": [1.0], "p_total": [0.0, 1.0]})
