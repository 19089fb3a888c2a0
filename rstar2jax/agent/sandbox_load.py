"""A closed-loop load driver for a ``sandbox_server``, used by its tests and ``experiments/bench_sandbox.py``:
many distinct calls at a fixed number in flight through :class:`SandboxClient`, checked for answers, losses,
exactly-once execution and the server's memory."""

from __future__ import annotations

import asyncio
import collections
import threading
import time

from rstar2jax.agent.sandbox_client import SandboxClient


def percentiles(latencies: list[float]) -> dict:
    """p50 / p95 / p99 of ``latencies`` (seconds) in milliseconds."""
    ordered = sorted(latencies)

    def at(q):
        return 1e3 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"p50_ms": at(0.50), "p95_ms": at(0.95), "p99_ms": at(0.99)}


async def drive_closed_loop(run_one, codes: list[str], in_flight: int):
    """Closed loop: ``in_flight`` drivers, each issuing the next code as soon as its last call returns.

    Returns (results, latencies, wall seconds). A fixed set of drivers rather than one task per code behind
    a semaphore: creating thousands of tasks at once stalls the event loop for 15-30 ms before the first
    request goes out, and that stall would count as the first calls' latency (and, for a 64-call batch,
    as the run's p99).
    """
    results: list = [None] * len(codes)
    latencies = [0.0] * len(codes)
    todo = iter(enumerate(codes))  # shared: each driver takes the next unclaimed code

    async def driver():
        for i, code in todo:
            start = time.perf_counter()
            results[i] = await run_one(code)
            latencies[i] = time.perf_counter() - start

    start = time.perf_counter()
    await asyncio.gather(*(driver() for _ in range(min(in_flight, len(codes)))))
    return results, latencies, time.perf_counter() - start


class RssSampler:
    """Samples the resident memory of the server's processes in the background; keeps the maxima (MiB)."""

    def __init__(self, health: dict, period: float = 0.25):
        workers = [w["pid"] for w in health["workers"]] + [
            w["fork_server_pid"] for w in health["workers"] if w["fork_server_pid"]
        ]
        self.pids = {"frontend": [health["server_pid"]], "workers": workers}
        self.max_mib = dict.fromkeys(self.pids, 0.0)
        self.period = period
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self):
        while not self._stop.is_set():
            for kind, pids in self.pids.items():
                for pid in pids:
                    try:
                        with open(f"/proc/{pid}/status") as f:
                            rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
                    except (OSError, StopIteration):
                        continue
                    self.max_mib[kind] = max(self.max_mib[kind], rss / 1024)
            self._stop.wait(self.period)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc_info):
        self._stop.set()
        self._thread.join()


def load_test(server, n_calls: int = 20000, in_flight: int = 512) -> dict:
    """``n_calls`` distinct calls at ``in_flight`` outstanding: answered correctly, lost, executed, RSS."""
    codes = [f"print({i})" for i in range(n_calls)]
    before = server.get("/metrics")

    async def main():
        async with SandboxClient(server.url) as client:
            return await drive_closed_loop(client.run, codes, in_flight)

    with RssSampler(server.get("/health")) as rss:
        results, latencies, wall = asyncio.run(main())
    after = server.get("/metrics")
    answered = sum(r.ok and r.stdout == f"{i}\n" for i, r in enumerate(results))
    executed = after["results_total"] - before["results_total"]
    rejected = after["http_rejected"].get("503", 0) - before["http_rejected"].get("503", 0)
    return {
        "calls": n_calls,
        "in_flight": in_flight,
        "answered": answered,
        "lost": n_calls - answered,
        "statuses": dict(collections.Counter(r.status for r in results)),
        "executed_by_server": executed,
        "rejected_503": rejected,
        "calls_per_s": n_calls / wall,
        **percentiles(latencies),
        "max_rss_mib": rss.max_mib,
        "worker_restarts": after["worker_restarts"],
    }
