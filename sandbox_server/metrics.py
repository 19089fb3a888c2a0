"""Counters for ``GET /metrics``: results by status, a latency histogram, and where the time goes."""

from __future__ import annotations

import bisect
import collections

LATENCY_BUCKETS_MS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 30000, 60000)

# Phases of a call, in order, each measured between two CLOCK_MONOTONIC stamps (shared by all processes):
#   queue        admitted by the front end -> sent to a worker (waiting for a free slot)
#   to_worker    sent -> read by the worker
#   fork         the worker's fork(), or its request to the fork server until the reply (page-table copy)
#   child_setup  fork returned -> user code starts (namespaces, tmpfs, rlimits, uid, stdio); a call forked
#                by the fork server may start before the worker has the reply, so the boundary between
#                these two is the earlier of the two stamps
#   execution    the user code itself
#   exit_reap    code finished -> the worker has reaped the child and drained its pipes
#   to_frontend  worker reaped -> the front end has the result
PHASES = ("queue", "to_worker", "fork", "child_setup", "execution", "exit_reap", "to_frontend")


class Metrics:
    def __init__(self) -> None:
        self.status_counts: collections.Counter = collections.Counter()
        self.latency_counts = [0] * (len(LATENCY_BUCKETS_MS) + 1)
        self.phase_seconds = dict.fromkeys(PHASES, 0.0)
        self.phase_samples = 0
        self.call_cpu_seconds = 0.0  # CPU time of the calls' own process trees (one-shot calls)
        self.call_cpu_samples = 0
        self.call_page_faults = 0
        self.http_requests: collections.Counter = collections.Counter()  # endpoint -> count
        self.rejected: collections.Counter = collections.Counter()  # http status -> count
        self.frontend_seconds = 0.0  # handler time spent decoding, validating and encoding (not waiting)
        self.worker_restarts = 0

    def observe_call(self, status: str, latency_s: float, stamps: dict | None) -> None:
        """Record one finished call. ``stamps`` holds the monotonic times of the phase boundaries."""
        self.status_counts[status] += 1
        self.latency_counts[bisect.bisect_left(LATENCY_BUCKETS_MS, latency_s * 1e3)] += 1
        if not stamps:
            return
        if stamps.get("cpu_seconds") is not None:
            self.call_cpu_seconds += stamps["cpu_seconds"]
            self.call_page_faults += stamps.get("page_faults", 0)
            self.call_cpu_samples += 1
        order = (
            "admitted",
            "dispatched",
            "received",
            "fork_start",
            "fork_end",
            "exec_start",
            "exec_end",
            "exit_seen",
            "returned",
        )
        if any(stamps.get(name) is None for name in order):
            return
        s = stamps
        forked = min(s["fork_end"], s["exec_start"])
        spans = {
            "queue": s["dispatched"] - s["admitted"],
            "to_worker": s["fork_start"] - s["dispatched"],
            "fork": forked - s["fork_start"],
            "child_setup": s["exec_start"] - forked,
            "execution": s["exec_end"] - s["exec_start"],
            "exit_reap": s["exit_seen"] - s["exec_end"],
            "to_frontend": s["returned"] - s["exit_seen"],
        }
        for phase, seconds in spans.items():
            self.phase_seconds[phase] += seconds
        self.phase_samples += 1

    def snapshot(self) -> dict:
        buckets = [f"le_{b}ms" for b in LATENCY_BUCKETS_MS] + ["inf"]
        samples = max(self.phase_samples, 1)
        return {
            "results_by_status": dict(self.status_counts),
            "results_total": sum(self.status_counts.values()),
            "latency_histogram": dict(zip(buckets, self.latency_counts, strict=True)),
            "phase_mean_ms": {phase: 1e3 * total / samples for phase, total in self.phase_seconds.items()},
            "phase_samples": self.phase_samples,
            "phase_seconds_total": dict(self.phase_seconds),
            "call_cpu_mean_ms": 1e3 * self.call_cpu_seconds / max(self.call_cpu_samples, 1),
            "call_page_faults_mean": self.call_page_faults / max(self.call_cpu_samples, 1),
            "frontend_seconds_total": self.frontend_seconds,
            "http_requests": dict(self.http_requests),
            "http_rejected": {str(k): v for k, v in self.rejected.items()},
            "worker_restarts": self.worker_restarts,
        }
