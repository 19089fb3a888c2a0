"""Benchmark sandbox_server against a fresh ``python3`` process per snippet (the paper's tool-server method).

    python -m experiments.bench_sandbox              # trivial + mixed workloads, 2 workers, 64 in flight
    python -m experiments.bench_sandbox --load_test  # + 20,000 calls at 512 in flight (answered, lost, RSS)

Workloads: "trivial" (``print(1 + 1)``-like) and "mixed" (70% trivial, 20% numpy, 10% sympy). The sandbox
is driven through ``rstar2jax.agent.sandbox_client.SandboxClient`` (micro-batching), the baseline runs each
snippet in a new interpreter (``python3 file.py``, as the released code's tool server does) with the same
number in flight. Reports calls/s and latency percentiles for both, their ratios, and where the sandbox's
time goes (front end, queueing, fork, child setup, execution, exit/reap) from its /metrics plus per-process
CPU accounting. The last line is a JSON object of the figures.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import random
import sys
import tempfile
import time

from absl import app, flags

from rstar2jax.agent.sandbox_client import SandboxClient
from rstar2jax.agent.sandbox_load import drive_closed_loop, load_test, percentiles
from sandbox_server import start_local
from sandbox_server.config import ServerConfig

TRIVIAL = (
    "print(1 + 1)",
    "x = 21\nprint(x * 2)",
    "print(sum(range(100)))",
    "s = 'abc'\nprint(s[::-1])",
    "from math import comb\nprint(comb(10, 3))",
)
NUMPY = (
    "import numpy as np\na = np.arange(12).reshape(3, 4)\nprint(a.sum(axis=0))",
    "import numpy as np\nm = np.random.rand(40, 40)\nprint(np.linalg.det(m @ m.T) >= 0)",
)
SYMPY = (
    "import sympy as sp\nx = sp.symbols('x')\nprint(sp.factor(x**4 - 1))",
    "import sympy as sp\nx = sp.symbols('x')\nprint(sp.solve(x**2 - 5*x + 6, x))",
)


def workload(name: str, n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    if name == "trivial":
        return [rng.choice(TRIVIAL) for _ in range(n)]
    pools = [(0.7, TRIVIAL), (0.2, NUMPY), (0.1, SYMPY)]
    return [rng.choice(rng.choices([p for _, p in pools], [w for w, _ in pools])[0]) for _ in range(n)]


async def run_sandbox(url: str, codes: list[str], in_flight: int):
    async with SandboxClient(url) as client:
        await drive_closed_loop(client.run, codes[: min(200, len(codes))], in_flight)  # warm the pool
        results, latencies, wall = await drive_closed_loop(client.run, codes, in_flight)
    statuses = collections.Counter(r.status for r in results)
    return {
        "calls": len(codes),
        "calls_per_s": len(codes) / wall,
        **percentiles(latencies),
        "statuses": statuses,
    }


async def run_baseline(codes: list[str], in_flight: int, python: str):
    workdir = tempfile.mkdtemp(prefix="bench_sandbox_baseline-")

    async def one(code):
        path = os.path.join(workdir, f"{id(code)}-{time.perf_counter_ns()}.py")
        with open(path, "w") as f:
            f.write(code)
        process = await asyncio.create_subprocess_exec(
            python, path, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=workdir
        )
        await process.communicate()
        os.unlink(path)
        return "ok" if process.returncode == 0 else "error"

    results, latencies, wall = await drive_closed_loop(one, codes, in_flight)
    os.rmdir(workdir)
    return {
        "calls": len(codes),
        "calls_per_s": len(codes) / wall,
        **percentiles(latencies),
        "statuses": collections.Counter(results),
    }


def _process_cpu(pid: int) -> tuple[float, float]:
    """(own CPU seconds, reaped children's CPU seconds) of a process."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks, (int(fields[13]) + int(fields[14])) / ticks


def cpu_snapshot(health: dict) -> dict:
    """CPU seconds so far: the front end, the warm workers (with their fork servers), and the calls (children
    reaped by workers)."""
    frontend = _process_cpu(health["server_pid"])[0]
    workers = calls = 0.0
    for worker in health["workers"]:
        own, children = _process_cpu(worker["pid"])
        workers += own + (_process_cpu(worker["fork_server_pid"])[0] if worker["fork_server_pid"] else 0.0)
        calls += children
    return {"frontend": frontend, "workers": workers, "calls": calls}


def breakdown(server, codes: list[str], in_flight: int) -> dict:
    """Where a call's time goes: wall-clock phases (means) and CPU per call by process kind."""
    health = server.get("/health")
    metrics_before, cpu_before = server.get("/metrics"), cpu_snapshot(health)
    asyncio.run(run_sandbox(server.url, codes, in_flight))
    metrics_after, cpu_after = server.get("/metrics"), cpu_snapshot(health)
    samples = metrics_after["phase_samples"] - metrics_before["phase_samples"]
    calls = len(codes) + min(200, len(codes))
    totals_before, totals_after = metrics_before["phase_seconds_total"], metrics_after["phase_seconds_total"]
    wall = {phase: 1e3 * (totals_after[phase] - totals_before[phase]) / samples for phase in totals_after}
    frontend_handler = metrics_after["frontend_seconds_total"] - metrics_before["frontend_seconds_total"]
    cpu = {kind: 1e3 * (cpu_after[kind] - cpu_before[kind]) / calls for kind in cpu_after}
    return {
        "wall_ms": wall,
        "cpu_ms_per_call": cpu,
        "frontend_handler_ms_per_call": 1e3 * frontend_handler / calls,
    }


_CALLS = flags.DEFINE_integer("calls", 3000, "sandbox calls per workload")
_BASELINE_CALLS = flags.DEFINE_integer("baseline_calls", 300, "fresh-interpreter calls per workload")
_IN_FLIGHT = flags.DEFINE_integer("in_flight", 64, "calls outstanding at once")
_WORKERS = flags.DEFINE_integer("workers", 2, "sandbox worker processes")
_SLOTS = flags.DEFINE_integer("slots", ServerConfig.slots, "calls at once per worker")
_PYTHON = flags.DEFINE_string("python", sys.executable, "interpreter for the baseline")
_SERVER_PYTHON = flags.DEFINE_string(
    "server_python", sys.executable, "interpreter the sandbox server and its calls run on"
)
_LOAD_TEST = flags.DEFINE_bool("load_test", False, "also 20,000 calls at 512 in flight")


def main(argv) -> None:
    del argv
    args = flags.FLAGS
    figures: dict = {"load_average_before": os.getloadavg(), "cpus": os.cpu_count()}
    rows = []
    with start_local(workers=args.workers, slots=args.slots, python=args.server_python) as server:
        for name in ("trivial", "mixed"):
            sandbox = asyncio.run(run_sandbox(server.url, workload(name, args.calls, seed=1), args.in_flight))
            baseline = asyncio.run(
                run_baseline(workload(name, args.baseline_calls, seed=2), args.in_flight, args.python)
            )
            ratio = sandbox["calls_per_s"] / baseline["calls_per_s"]
            figures[name] = {
                "sandbox": sandbox,
                "baseline": baseline,
                "throughput_ratio": ratio,
                "p50_ratio": baseline["p50_ms"] / sandbox["p50_ms"],
            }
            rows += [(name, "sandbox", sandbox), (name, "fresh python3", baseline)]
        figures["breakdown_trivial"] = breakdown(
            server, workload("trivial", args.calls, seed=3), args.in_flight
        )
        figures["breakdown_mixed"] = breakdown(server, workload("mixed", args.calls, seed=4), args.in_flight)
    if args.load_test:
        with start_local(workers=args.workers, slots=args.slots, max_queue=256) as server:
            figures["load_test"] = load_test(server)
    figures["load_average_after"] = os.getloadavg()

    header = ("workload", "method", "calls", "calls/s", "p50 ms", "p95 ms", "p99 ms")
    print("\n{:10s} {:14s} {:>6s} {:>9s} {:>9s} {:>9s} {:>9s}  statuses".format(*header))
    for name, method, r in rows:
        figures_row = (r["calls"], r["calls_per_s"], r["p50_ms"], r["p95_ms"], r["p99_ms"])
        print(
            f"{name:10s} {method:14s} " + "{:6d} {:9.1f} {:9.1f} {:9.1f} {:9.1f}".format(*figures_row),
            dict(r["statuses"]),
        )
    for name in ("trivial", "mixed"):
        print(
            f"{name}: sandbox / fresh python3 = {figures[name]['throughput_ratio']:.1f}x calls/s, "
            f"{figures[name]['p50_ratio']:.1f}x lower p50"
        )
    for name in ("breakdown_trivial", "breakdown_mixed"):
        b = figures[name]
        print(f"\n{name} (mean wall ms per call, phases overlap across calls):")
        print("  " + ", ".join(f"{k} {v:.2f}" for k, v in b["wall_ms"].items()))
        print(
            "  CPU ms per call: "
            + ", ".join(f"{k} {v:.2f}" for k, v in b["cpu_ms_per_call"].items())
            + f" (front-end handler {b['frontend_handler_ms_per_call']:.3f})"
        )
    if "load_test" in figures:
        print(f"\nload test: {json.dumps(figures['load_test'])}")
    print(f"load average before/after: {figures['load_average_before']} / {figures['load_average_after']}")
    for name in ("trivial", "mixed"):
        for method in ("sandbox", "baseline"):
            figures[name][method]["statuses"] = dict(figures[name][method]["statuses"])
    print(json.dumps(figures))


if __name__ == "__main__":
    app.run(main)
