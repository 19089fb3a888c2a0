"""The rollout and sandbox failures (issue 20 item 7) and the stateful tool option (issue 19 item 7)."""

import asyncio
import collections

from rstar2jax.agent import RolloutConfig, SandboxClient, SandboxResult, rollout_async
from rstar2jax.agent.rollout_types import INFRA_OUTCOMES, drop_infra_failures, tool_outcome
from rstar2jax.data.chat_template import encode_text
from sandbox_server import start_local
from tests.agent import test_rollout
from tests.agent.test_rollout import (
    ANSWER,
    PROBLEM,
    ScriptedEngine,
    ScriptedSandbox,
    call_text,
    encode_turns,
    run,
)

WORKER_DIED = SandboxResult("killed", "", "sandbox: its worker died\n", None, "WorkerDied", 0.0)
tokenizer, verifier = test_rollout.tokenizer, test_rollout.verifier  # the module's fixtures, shared


class FlakySandbox(ScriptedSandbox):
    """Fails each code's first ``failures`` runs with ``failure``, then answers as ScriptedSandbox."""

    def __init__(self, failures: int, failure=WORKER_DIED):
        super().__init__()
        self.failures, self.failure, self.seen = failures, failure, collections.Counter()

    async def run(self, code, stdin="", timeout=None):
        self.seen[code] += 1
        if self.seen[code] <= self.failures:
            self.calls.append((code, stdin, timeout))
            return self.failure
        return await super().run(code, stdin, timeout)


def test_infrastructure_failures_are_retried_and_never_count_as_the_models_errors(tokenizer, verifier):
    assert tool_outcome(WORKER_DIED) in INFRA_OUTCOMES
    unreachable = SandboxResult.failure("cannot connect", error_type="Unreachable")
    assert tool_outcome(unreachable) in INFRA_OUTCOMES
    model_error = SandboxResult("error", "", "NameError\n", 1, "NameError", 0.1)
    assert tool_outcome(model_error) not in INFRA_OUTCOMES

    stats = collections.Counter()
    config = RolloutConfig(tool_infra_retries=2)
    engine = ScriptedEngine([[encode_turns(tokenizer, call_text(), ANSWER)]],
                            [encode_text(tokenizer, "<|im_end|>")[0]])
    (t,) = asyncio.run(rollout_async([PROBLEM], 1, engine=engine, sandbox=FlakySandbox(2),
                                     tokenizer=tokenizer, verifier=verifier, config=config, stats=stats))
    assert t.tool_outcomes == ["ok"] and t.reward == 1.0
    assert stats["sandbox_retried_calls"] == 1 and stats["sandbox_worker_deaths"] == 2  # one call run 3 times

    (t,), _, sandbox = run(tokenizer, verifier, [[encode_turns(tokenizer, call_text(), ANSWER)]],
                           sandbox=FlakySandbox(3), config=config)
    assert t.tool_outcomes == ["internal"] and len(sandbox.calls) == 3  # 1 + 2 retries, then given up
    kept, dropped = drop_infra_failures([t, t.__class__(**{**t.__dict__, "tool_outcomes": ["error"]})])
    assert dropped == 1 and [k.tool_outcomes for k in kept] == [["error"]]  # the model's error stays


def test_model_errors_are_not_retried(tokenizer, verifier):
    error = SandboxResult("error", "", "NameError\n", 1, "NameError", 0.1)
    (t,), _, sandbox = run(tokenizer, verifier, [[encode_turns(tokenizer, call_text("boom()"), ANSWER)]],
                           sandbox=ScriptedSandbox({"boom()": error}),
                           config=RolloutConfig(tool_infra_retries=2))
    assert t.tool_outcomes == ["error"] and len(sandbox.calls) == 1


def test_stateful_tool_keeps_variables_across_turns_and_closes_its_session(tokenizer, verifier):
    turns = [call_text("x = 41"), call_text("print(x + 1)"), ANSWER]
    with start_local(workers=1, slots=2, tiers="base,full", max_sessions=4) as server:

        async def main(stateful: bool):
            async with SandboxClient(server.url) as client:
                seen = []
                original = client.run

                async def recording_run(code, stdin="", timeout=None, session=None):
                    result = await original(code, stdin=stdin, timeout=timeout, session=session)
                    seen.append((session, result))
                    return result

                client.run = recording_run
                engine = ScriptedEngine([[encode_turns(tokenizer, *turns)]] * 1,
                                        [encode_text(tokenizer, "<|im_end|>")[0]])
                (t,) = await rollout_async([PROBLEM], 1, engine=engine, sandbox=client, tokenizer=tokenizer,
                                           verifier=verifier, config=RolloutConfig(stateful_tool=stateful))
                return t, seen, (await client.metrics())["sessions"]

        t, seen, sessions_left = asyncio.run(main(True))
        assert t.tool_outcomes == ["ok", "ok"] and seen[1][1].stdout == "42\n", seen
        session = seen[0][0]
        assert session is not None and session == seen[1][0] and len(session) > 20  # unguessable id
        assert sessions_left == 0  # closed when the trajectory ended

        t, seen, _ = asyncio.run(main(False))  # default: stateless, the variable is gone
        assert seen[0][0] is None and t.tool_outcomes == ["ok", "error"]
        assert seen[1][1].error_type == "NameError"
