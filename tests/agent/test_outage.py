"""Sandbox outages during a rollout (issue 33): waited out with back-off and never shown to the model, a
sandbox gone past the budget stopping the rollout in one line, calls the service refuses stopping it at once,
a crashed server the run owns restarted, a killed worker's call run again."""

import asyncio
import collections
import logging
import os
import signal
import threading
import time

import pytest

from rstar2jax.agent import (
    OutagePolicy,
    RolloutConfig,
    SandboxClient,
    SandboxResult,
    SandboxUnavailable,
    rollout_async,
    tool_outcome,
    tool_response_ids,
)
from rstar2jax.agent.outage import failure_kind
from rstar2jax.data.chat_template import encode_text
from sandbox_server import start_local
from tests.agent import test_rollout
from tests.agent.test_rollout import ANSWER, PROBLEM, ScriptedEngine, ScriptedSandbox, call_text, encode_turns

tokenizer, verifier = test_rollout.tokenizer, test_rollout.verifier  # the module's fixtures, shared

UNREACHABLE = SandboxResult.failure("cannot connect to http://x (is the server down?)",
                                    error_type="Unreachable")
FAST = dict(backoff=(0.02, 0.1))


def test_failure_kinds():
    def result(status, error_type):
        return SandboxResult(status, "", "why\n", None, error_type, 0.0)

    assert [failure_kind(result("internal", t)) for t in
            ("Unreachable", "ConnectionError", "DeadlineExceeded", "BadResponse", "HTTP503", "HTTP500", None)
            ] == ["outage"] * 7  # None: the server's own "could not run it"
    assert [failure_kind(result("internal", t)) for t in ("HTTP401", "HTTP404")] == ["rejected"] * 2
    assert failure_kind(result("killed", "WorkerDied")) == "worker"
    # The model's own results, and a client closing with the run, are shown as they are.
    for status, error_type in [("error", "NameError"), ("timeout", None), ("killed", "SIGKILL"),
                               ("memory_limit", None), ("killed", "SessionClosed"),
                               ("internal", "ClientClosed")]:
        assert failure_kind(result(status, error_type)) is None


class DownFor(ScriptedSandbox):
    """Unreachable until ``seconds`` after its first call (``forever``: never answers)."""

    def __init__(self, seconds=0.0, failure=UNREACHABLE):
        super().__init__()
        self.seconds, self.failure, self.first, self.tries = seconds, failure, None, collections.Counter()

    async def run(self, code, stdin="", timeout=None):
        self.first = self.first or time.monotonic()
        self.tries[code] += 1
        if time.monotonic() - self.first < self.seconds:
            await asyncio.sleep(0.001)
            return self.failure
        return await super().run(code, stdin, timeout)


def rollout_with(sandbox, tokenizer, verifier, *, n=4, outage=None, config=None, stats=None):
    codes = [f"print({i})" for i in range(n)]
    engine = ScriptedEngine([[encode_turns(tokenizer, call_text(c), ANSWER) for c in codes]],
                            [encode_text(tokenizer, "<|im_end|>")[0]])

    async def main():
        return await rollout_async([PROBLEM], n, engine=engine, sandbox=sandbox, tokenizer=tokenizer,
                                   verifier=verifier, config=config or RolloutConfig(), stats=stats,
                                   outage=outage)

    return asyncio.run(asyncio.wait_for(main(), 60)), engine


def test_an_outage_shorter_than_the_budget_is_waited_out_and_never_seen_by_the_model(tokenizer, verifier):
    lines, stats = [], collections.Counter()
    sandbox = DownFor(0.3)
    trajectories, engine = rollout_with(sandbox, tokenizer, verifier, stats=stats,
                                        outage=OutagePolicy(budget_s=30, log=lines.append, **FAST))
    assert [t.tool_outcomes for t in trajectories] == [["ok"]] * 4
    assert all(t.reward == 1.0 for t in trajectories)
    assert [s.appended for s in engine.sessions] == [[tool_response_ids(tokenizer, "1024\n")]] * 4
    assert all(tries >= 2 for tries in sandbox.tries.values())  # every call waited and was tried again
    assert stats["sandbox_retried_calls"] == 4 and stats["sandbox_outages"] == 1
    assert 0.25 <= stats["sandbox_outage_s"] < 5  # from the first failure seen to the first answer
    assert lines[0].startswith("sandbox service is not answering (Unreachable: sandbox client: cannot")
    assert lines[-1].startswith("sandbox service answers again after") and len(lines) == 2


def test_a_sandbox_down_past_the_budget_stops_the_rollout_in_one_line(tokenizer, verifier):
    start = time.monotonic()
    with pytest.raises(SandboxUnavailable) as raised:
        rollout_with(DownFor(float("inf")), tokenizer, verifier,
                     outage=OutagePolicy(budget_s=0.3, log=print, **FAST))
    assert time.monotonic() - start < 10
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("the sandbox service did not answer for 0 s (outage budget 0.3 s): ")
    assert "4 calls were tried" in message and "back-off from 0.02 to 0.1 s" in message
    assert message.endswith("last error: Unreachable: sandbox client: cannot connect to http://x (is the "
                            "server down?)")


def test_calls_the_service_refuses_stop_at_once(tokenizer, verifier):
    refused = SandboxResult.failure("HTTP 401 from http://x: 'missing or wrong bearer token'",
                                    error_type="HTTP401")
    with pytest.raises(SandboxUnavailable, match=r"rejects the calls \(HTTP401: .*no wait helps"):
        rollout_with(DownFor(float("inf"), refused), tokenizer, verifier, outage=OutagePolicy(budget_s=60))


def test_a_session_call_is_tried_again_only_when_it_never_reached_the_server(tokenizer, verifier, caplog):
    class SessionSandbox(DownFor):
        async def run(self, code, stdin="", timeout=None, session=None):
            return await super().run(code, stdin, timeout)

        async def close_session(self, session):
            return True

    config = RolloutConfig(stateful_tool=True)
    caplog.set_level(logging.WARNING, logger="rstar2jax.agent.outage")
    (t, *_), _ = rollout_with(SessionSandbox(0.2), tokenizer, verifier, config=config,
                              outage=OutagePolicy(budget_s=30, **FAST))
    assert t.tool_outcomes == ["ok"]
    # Without a ``log`` the outage lines go to the module's logger as warnings.
    logged = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "rstar2jax.agent.outage"]
    assert logged[0][0] == logging.WARNING and logged[0][1].startswith("sandbox service is not answering")
    assert logged[-1][1].startswith("sandbox service answers again after") and len(logged) == 2
    lost = SandboxResult.failure("request failed: ServerDisconnectedError", error_type="ConnectionError")
    (t, *_), _ = rollout_with(SessionSandbox(0.2, lost), tokenizer, verifier, config=config,
                              outage=OutagePolicy(budget_s=30, log=print, **FAST))
    assert t.tool_outcomes == ["unreachable"]  # it may have run: not run twice


def test_an_owned_sandbox_rides_out_a_killed_worker_and_a_crashed_server(tokenizer, verifier):
    """One real server: first its worker is killed under a call (the server restarts it; the call runs again),
    then the server itself is killed mid-rollout (the run owns it: the outage policy restarts it on its port
    and the waiting calls go through)."""
    lines = []
    slow = "import time\ntime.sleep(1.0)\nprint(1024)"
    eos = [encode_text(tokenizer, "<|im_end|>")[0]]
    with start_local(workers=1) as server:
        url = server.url
        policy = OutagePolicy(budget_s=60, restart=server.restart_if_dead, log=lines.append, **FAST)

        def kill_the_worker_when_busy():
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                busy = [w for w in server.get("/health")["workers"] if w["inflight"]]
                if busy:
                    return os.kill(busy[0]["pid"], signal.SIGKILL)
                time.sleep(0.02)

        class KillsTheServerOnItsFirstCall:
            def __init__(self, client):
                self.client, self.urls, self.killed = client, client.urls, False

            async def run(self, code, stdin="", timeout=None):
                if not self.killed:  # mid-rollout: the other sessions' calls are on their way too
                    self.killed = True
                    server.process.send_signal(signal.SIGKILL)
                    server.process.wait()
                return await self.client.run(code, stdin=stdin, timeout=timeout)

        async def main(sandbox_of, codes, stats):
            async with SandboxClient(server.url) as client:
                engine = ScriptedEngine([[encode_turns(tokenizer, call_text(c), ANSWER) for c in codes]], eos)
                return await rollout_async([PROBLEM], len(codes), engine=engine, sandbox=sandbox_of(client),
                                           tokenizer=tokenizer, verifier=verifier, stats=stats, outage=policy)

        worker_stats, crash_stats = collections.Counter(), collections.Counter()
        killer = threading.Thread(target=kill_the_worker_when_busy)
        killer.start()
        (slow_one,) = asyncio.run(asyncio.wait_for(main(lambda c: c, [slow], worker_stats), 120))
        killer.join()
        crashed = asyncio.run(asyncio.wait_for(
            main(KillsTheServerOnItsFirstCall, [f"print({i} * 7)" for i in range(4)], crash_stats), 120))
        assert server.url == url and server.process.poll() is None  # back on the same port
    assert slow_one.tool_outcomes == ["ok"] and slow_one.reward == 1.0
    assert worker_stats["sandbox_worker_deaths"] == 1 and worker_stats["sandbox_retried_calls"] == 1
    assert [t.tool_outcomes for t in crashed] == [["ok"]] * 4
    assert crash_stats["sandbox_restarts"] == 1 and crash_stats["sandbox_retried_calls"] >= 1
    assert lines[0] == (f"sandbox {url}: a worker died under a call; the server restarts its workers and the "
                        "call runs again")
    restarted = [line for line in lines if "restarted it" in line]
    assert len(restarted) == 1 and restarted[0].startswith(f"sandbox server at {url} had exited (code -9)")


def test_results_the_service_made_up_are_infrastructure_outcomes():
    assert tool_outcome(UNREACHABLE) == "unreachable"
    lost = SandboxResult("invalid_request", "", "no session\n", None, "SessionNotFound", 0.0)
    assert tool_outcome(lost) == "internal"  # a session the server lost (it was restarted)
