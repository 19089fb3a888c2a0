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
import contextlib
import glob
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from absl import flags

from experiments import bench_record
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


async def run_sandbox(url: str, codes: list[str], in_flight: int, keep_latencies: bool = False):
    async with SandboxClient(url) as client:
        await drive_closed_loop(client.run, codes[: min(200, len(codes))], in_flight)  # warm the pool
        results, latencies, wall = await drive_closed_loop(client.run, codes, in_flight)
    statuses = collections.Counter(r.status for r in results)
    return {
        "calls": len(codes),
        "calls_per_s": len(codes) / wall,
        **percentiles(latencies),
        "statuses": statuses,
        **({"latencies": latencies} if keep_latencies else {}),
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


@contextlib.contextmanager
def server_from_checkout(directory: str, *, python: str, **limits):
    """A sandbox server run from another checkout's ``sandbox_server`` (e.g. ``git worktree add /tmp/base
    main``): its C fork server is built there first if missing. Yields the server's URL."""
    directory = os.path.abspath(directory)
    if not glob.glob(os.path.join(directory, "sandbox_server", "_spawn*.so")):
        build = (
            "from setuptools import Extension, setup; setup(name='sandbox_base', script_args=['build_ext', "
            "'--inplace', '-q'], ext_modules=[Extension('sandbox_server._spawn', "
            "['sandbox_server/_spawn.c'])])"
        )
        subprocess.run([python, "-c", build], cwd=directory, check=True, stdout=subprocess.DEVNULL)
    args = [python, "-m", "sandbox_server", "--host", "127.0.0.1", "--port", "0", "--stop-at-stdin-eof"]
    for name, value in limits.items():
        args += ["--" + name.replace("_", "-"), str(value)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = directory
    process = subprocess.Popen(args, cwd=directory, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    try:
        for line in process.stdout:
            if "listening on" in line:
                url = line.split("listening on", 1)[1].strip()
                break
        else:
            raise RuntimeError(f"the baseline server in {directory} did not start")
        threading.Thread(target=lambda: collections.deque(process.stdout, 0), daemon=True).start()
        yield url
    finally:
        process.stdin.close()
        process.terminate()
        process.wait(60)


def side_by_side(new_url: str, base_url: str, name: str, args) -> dict:
    """Alternating slices of the same workload on the new and the baseline server (order swapped every
    round, so drifting machine load hits both alike); calls/s over all slices and p99 of all calls."""
    sides = {"new": new_url, "baseline": base_url}
    totals = {side: {"calls": 0, "seconds": 0.0, "latencies": [], "statuses": collections.Counter(),
                     "cpu": collections.Counter()} for side in sides}
    order = list(sides)
    for round_index in range(args.ab_rounds):
        codes = workload(name, args.ab_slice, seed=100 + round_index)
        for side in order:
            health = _get_json(sides[side] + "/health")
            cpu_before = cpu_snapshot(health)
            result = asyncio.run(run_sandbox(sides[side], codes, args.in_flight, keep_latencies=True))
            cpu_after = cpu_snapshot(health)
            total = totals[side]
            total["cpu"].update({kind: cpu_after[kind] - cpu_before[kind] for kind in cpu_after})
            total["calls"] += result["calls"]
            total["seconds"] += result["calls"] / result["calls_per_s"]
            total["latencies"] += result.pop("latencies")
            total["statuses"].update(result["statuses"])
        order.reverse()
    figures = {}
    warmup = args.ab_rounds * min(200, args.ab_slice)  # run_sandbox's warm-up calls, in the CPU too
    for side, total in totals.items():
        figures[side] = {
            "calls": total["calls"],
            "calls_per_s": total["calls"] / total["seconds"],
            **percentiles(total["latencies"]),
            "statuses": dict(total["statuses"]),
            "cpu_ms_per_call": {
                kind: 1e3 * seconds / (total["calls"] + warmup) for kind, seconds in total["cpu"].items()
            },
        }
    figures["throughput_ratio"] = figures["new"]["calls_per_s"] / figures["baseline"]["calls_per_s"]
    return figures


_CALLS = flags.DEFINE_integer("calls", 3000, "sandbox calls per workload")
_BASELINE_CALLS = flags.DEFINE_integer("baseline_calls", 300, "fresh-interpreter calls per workload")
_IN_FLIGHT = flags.DEFINE_integer("in_flight", 64, "calls in flight")
_WORKERS = flags.DEFINE_integer("workers", 2, "sandbox workers")
_SLOTS = flags.DEFINE_integer("slots", ServerConfig.slots, "calls at once per worker")
_PYTHON = flags.DEFINE_string("python", sys.executable, "interpreter for the baseline")
_SERVER_PYTHON = flags.DEFINE_string(
    "server_python", sys.executable, "interpreter the sandbox server and its calls run on"
)
_LOAD_TEST = flags.DEFINE_bool("load_test", False, "also 20,000 calls at 512 in flight")
_BASELINE_DIR = flags.DEFINE_string(
    "baseline_dir",
    None,
    "A/B only: a checkout of the code to compare with (e.g. `git worktree add /tmp/base main`); its server "
    "and this one run side by side, alternating slices of calls",
)
_AB_ROUNDS = flags.DEFINE_integer("ab_rounds", 6, "A/B: slices per side and workload")
_AB_SLICE = flags.DEFINE_integer("ab_slice", 1000, "A/B: calls per slice")
_AB_WORKLOADS = flags.DEFINE_string("ab_workloads", "trivial,mixed", "A/B: workloads, comma-separated")
_NEW_OPTION = flags.DEFINE_multi_string(
    "new_option", [], "A/B: NAME=VALUE server option for this checkout's server only (call_memory_cgroups=0)"
)


def main(argv) -> None:
    del argv
    args = flags.FLAGS  # the flags by name
    if args.baseline_dir is not None:
        ab_main(args)
        return

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


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.load(response)


def _number(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def ab_main(args) -> None:
    """``--baseline_dir``: this checkout's server against the baseline's, same machine, same run."""
    figures: dict = {"load_average_before": os.getloadavg(), "cpus": os.cpu_count()}
    figures["baseline_dir"] = args.baseline_dir
    limits = dict(workers=args.workers, slots=args.slots)
    new_options = {name: _number(value) for name, value in (o.split("=", 1) for o in args.new_option)}
    figures["new_options"] = new_options
    with start_local(python=args.server_python, **limits, **new_options) as server, server_from_checkout(
        args.baseline_dir, python=args.server_python, **limits
    ) as base_url:
        for name in args.ab_workloads.split(","):
            figures[name] = side_by_side(server.url, base_url, name, args)
    figures["load_average_after"] = os.getloadavg()
    print("\n{:10s} {:9s} {:>6s} {:>9s} {:>9s} {:>9s}  statuses".format(
        "workload", "server", "calls", "calls/s", "p50 ms", "p99 ms"))
    for name in args.ab_workloads.split(","):
        for side in ("baseline", "new"):
            r = figures[name][side]
            cpu = ", ".join(f"{kind} {ms:.2f}" for kind, ms in r["cpu_ms_per_call"].items())
            print(f"{name:10s} {side:9s} {r['calls']:6d} {r['calls_per_s']:9.1f} {r['p50_ms']:9.1f} "
                  f"{r['p99_ms']:9.1f}  {r['statuses']}  CPU ms/call: {cpu}")
        print(f"{name}: new / baseline = {figures[name]['throughput_ratio']:.3f} calls/s")
    print(f"load average before/after: {figures['load_average_before']} / {figures['load_average_after']}")
    print(json.dumps(figures))


if __name__ == "__main__":
    bench_record.run(main)
