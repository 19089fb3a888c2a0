"""``--out=PATH`` for every benchmark: the run's record as JSON, for the docs' Measured page.

Each ``experiments/bench_*.py`` ends its output with one line of JSON (its figures). Run under
``bench_record.run(main)`` instead of ``app.run(main)``, a benchmark given ``--out=PATH`` also writes
``{"command", "commit", "date", "machine", "load", "seconds", "figures"}`` there: the command line as
typed, the checkout's commit (``-dirty`` with uncommitted changes), the UTC date, the CPU, its cores and the
JAX devices, the load average before and after, and that last line. ``python -m experiments.docs_gen``
renders every record under ``docs/results/`` into ``docs/measured.md``.
"""

from __future__ import annotations

import datetime
import io
import json
import os
import pathlib
import platform
import subprocess
import sys
import time

from absl import app, flags

REPO = pathlib.Path(__file__).resolve().parents[1]


class _Tee(io.TextIOBase):
    """Writes to the real stdout and keeps a copy, to find the last line afterwards."""

    def __init__(self, stream):
        self.stream, self.copy = stream, io.StringIO()

    def write(self, text: str) -> int:
        self.copy.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()


def last_json_line(text: str) -> dict | None:
    """The last line of ``text`` that is a JSON object, or None."""
    for line in reversed(text.strip().splitlines()):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return None


def commit() -> str:
    """HEAD's short hash, with ``-dirty`` when tracked files changed; ``unknown`` outside a git checkout."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout
    try:
        head = git("rev-parse", "--short", "HEAD").strip()
        dirty = bool(git("status", "--porcelain", "--untracked-files=no").strip())
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")


def machine() -> dict:
    """The CPU model, its cores and, when the benchmark imported JAX, the devices it ran on."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    found = {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version()}
    if "jax" in sys.modules:
        jax = sys.modules["jax"]
        found["jax"] = jax.__version__
        found["devices"] = sorted({f"{d.platform}:{d.device_kind}" for d in jax.devices()})
    return found


def record(argv: list[str], figures: dict, *, started: float, load_before: tuple) -> dict:
    module = pathlib.Path(argv[0]).stem
    return {
        "command": " ".join(["python -m experiments." + module, *argv[1:]]),
        "commit": commit(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": machine(),
        "load": {"before": [round(x, 2) for x in load_before],
                 "after": [round(x, 2) for x in os.getloadavg()]},
        "seconds": round(time.time() - started, 1),
        "figures": figures,
    }


def record_run(main, argv: list[str], out: str | None):
    """Runs ``main(argv)``; with ``out``, writes the run's record there (its figures: the last line of what
    it printed that is a JSON object; none is an error)."""
    if not out:
        return main(argv)
    started, load_before = time.time(), os.getloadavg()
    tee = _Tee(sys.stdout)
    sys.stdout = tee
    try:
        result = main(argv)
    finally:
        sys.stdout = tee.stream
    figures = last_json_line(tee.copy.getvalue())
    if figures is None:
        sys.exit(f"error: --out={out}: the benchmark printed no last-line JSON, nothing recorded")
    path = pathlib.Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record(sys.argv, figures, started=started, load_before=load_before),
                               indent=1) + "\n", encoding="utf-8")
    print(f"recorded in {path}")
    return result


def run(main) -> None:
    """``app.run(main)`` with ``--out=PATH`` (see the module docstring)."""
    flags.DEFINE_string("out", None, "write the run's record (command, commit, date, machine, load and the "
                        "figures of the last line) to this JSON file")
    app.run(lambda argv: record_run(main, argv, flags.FLAGS.out))
