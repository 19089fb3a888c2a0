"""Load: thousands of distinct calls at 512 in flight against 2 workers and a deliberately short queue.

Every call must come back with its own output (client retries after 503 are allowed), the server must
execute each exactly once, and its memory must stay bounded. The default run uses 3,000 calls; the full
20,000-call run is marked slow and is also part of ``experiments/bench_sandbox.py --load_test``.
"""

from __future__ import annotations

import pytest

from rstar2jax.agent.sandbox_load import load_test
from sandbox_server import start_local
from tests.sandbox_server.conftest import assert_clean

FRONTEND_RSS_LIMIT_MIB = 400
WORKER_RSS_LIMIT_MIB = 400


@pytest.fixture(scope="module")
def load_server():
    with start_local(workers=2, slots=8, max_queue=256) as running:
        yield running


def _check(report: dict, n_calls: int) -> None:
    assert report["answered"] == n_calls and report["lost"] == 0, report
    assert report["statuses"] == {"ok": n_calls}, report
    assert report["executed_by_server"] == n_calls, report  # exactly once: rejected batches never ran
    assert report["rejected_503"] > 0, report  # the queue bound was hit, and the client retried
    assert report["max_rss_mib"]["frontend"] < FRONTEND_RSS_LIMIT_MIB, report
    assert report["max_rss_mib"]["workers"] < WORKER_RSS_LIMIT_MIB, report
    assert report["worker_restarts"] == 0, report


def test_load_every_call_answered_once(load_server):
    _check(load_test(load_server, n_calls=3000, in_flight=512), 3000)
    assert_clean(load_server.url)


@pytest.mark.slow
def test_load_20000_calls(load_server):
    _check(load_test(load_server, n_calls=20000, in_flight=512), 20000)
    assert_clean(load_server.url)
