"""The agentic rollout against a scripted engine (fixed token streams) and a scripted sandbox: exact token
streams and loss masks, limits, parse-error feedback, truncation, per-call outcomes, grouping, concurrency."""

import asyncio
import dataclasses
import json
import socket

import pytest

from rstar2jax.agent import (
    PYTHON_TOOL_NAME,
    OutagePolicy,
    PartialRollout,
    PromptConfig,
    RolloutConfig,
    SandboxClient,
    SandboxResult,
    SandboxUnavailable,
    Trajectory,
    format_tool_result,
    parse_tool_call,
    render_prompt_ids,
    rollout,
    rollout_async,
    tool_outcome,
    tool_response_ids,
)
from rstar2jax.data.chat_template import encode_text
from rstar2jax.data.problems import Problem
from rstar2jax.data.tokenizer import train_tiny_tokenizer
from rstar2jax.engine import SamplingParams, Segment
from rstar2jax.reward import AnswerVerifier

PROBLEM = Problem(id="p0", problem="What is 2 to the power 10?", answer="1024")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    corpus = [PROBLEM.problem, "print(2 ** 10)", "The answer is <answer>\\boxed{1024}</answer>"] * 10
    return train_tiny_tokenizer(corpus, vocab_size=320, out_dir=tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def verifier():
    with AnswerVerifier(num_workers=1) as v:
        yield v


def call_text(code="print(2 ** 10)", name=PYTHON_TOOL_NAME, stdin=""):
    body = json.dumps({"name": name, "arguments": {"code": code, "input": stdin}})
    return f" Let me compute.</reason>\n<tool_call>\n{body}\n</tool_call>"


ANSWER = " So it is 1024.</reason>\n<answer>\\boxed{1024}</answer><|im_end|>"


def logprob(step: int) -> float:
    """The scripted sampler's log-prob of its step-th sampled token (distinct per token)."""
    return -0.01 * (step + 1)


class ScriptedSession:
    """Replays one fixed stream of "sampled" tokens with the engine session's stop rules (EOS > budget >
    stop > length) and budget accounting (appended tokens count)."""

    def __init__(self, engine, script: list[int], max_tokens: int):
        self.engine = engine
        self.script = list(script)
        self.remaining = max_tokens
        self.sampled = 0
        self.done = False
        self.closed = False
        self.appended: list[list[int]] = []

    async def generate(self, *, stop=(), max_new_tokens=None) -> Segment:
        assert not (self.done or self.closed), "generate on a finished or closed session"
        await asyncio.sleep(0)  # let other sessions interleave, as with a real engine
        tokens, reason = [], None
        if self.remaining == 0:
            self.done = True
            return Segment([], [], "budget")
        while reason is None:
            assert self.script, "the rollout asked for more tokens than the script holds"
            tokens.append(self.script.pop(0))
            self.remaining -= 1
            if tokens[-1] in self.engine.eos_ids:
                reason = "eos"
            elif self.remaining == 0:
                reason = "budget"
            elif any(len(s) <= len(tokens) and tokens[-len(s):] == list(s) for s in stop):
                reason = "stop"
            elif max_new_tokens is not None and len(tokens) >= max_new_tokens:
                reason = "length"
        self.done = reason in ("eos", "budget")
        logprobs = [logprob(self.sampled + i) for i in range(len(tokens))]
        self.sampled += len(tokens)
        return Segment(tokens, logprobs, reason)

    def append(self, token_ids):
        assert not (self.done or self.closed)
        if len(token_ids) > self.remaining:
            raise ValueError("appended past the budget")
        self.appended.append(list(token_ids))
        self.remaining -= len(token_ids)

    def close(self):
        self.closed = True


class ScriptedEngine:
    """``open`` hands out sessions replaying ``scripts[group][sample]`` (token lists), groups in order."""

    def __init__(self, scripts, eos_ids):
        self.scripts = list(scripts)
        self.eos_ids = set(eos_ids)
        self.opened: list[dict] = []
        self.sessions: list[ScriptedSession] = []
        self.running = False

    async def open(self, prompt_ids, n=1, *, sampling, max_tokens, seed=None):
        scripts = self.scripts[len(self.opened)]
        assert len(scripts) == n
        self.opened.append(dict(prompt_ids=list(prompt_ids), n=n, sampling=sampling, max_tokens=max_tokens,
                                seed=seed))
        sessions = [ScriptedSession(self, s, max_tokens) for s in scripts]
        self.sessions += sessions
        return sessions

    async def __aenter__(self):
        self.running = True
        return self

    async def __aexit__(self, *exc_info):
        self.running = False


class ScriptedSandbox:
    """Answers each code string from ``results`` (default: prints 1024), optionally after a delay; records
    calls and the most calls in flight at once."""

    def __init__(self, results=None, delay=0.0):
        self.results = results or {}
        self.delay = delay
        self.calls: list[tuple[str, str, float]] = []
        self.in_flight = self.max_in_flight = 0

    async def run(self, code, stdin="", timeout=None):
        self.calls.append((code, stdin, timeout))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay)
        finally:
            self.in_flight -= 1
        return self.results.get(code, ok("1024\n"))


def ok(stdout):
    return SandboxResult("ok", stdout, "", 0, None, 0.01)


def encode_turns(tokenizer, *turns):
    """Script of a model writing ``turns`` (each encoded on its own, as the model would sample them)."""
    return [t for turn in turns for t in encode_text(tokenizer, turn)]


def run(tokenizer, verifier, scripts, *, sandbox=None, config=None, problems=(PROBLEM,), eos=("<|im_end|>",)):
    config = config or RolloutConfig()
    engine = ScriptedEngine(scripts, [encode_text(tokenizer, e)[0] for e in eos])
    sandbox = sandbox or ScriptedSandbox()
    trajectories = asyncio.run(rollout_async(
        list(problems), len(scripts[0]), engine=engine, sandbox=sandbox, tokenizer=tokenizer,
        verifier=verifier, config=config))
    assert all(s.closed for s in engine.sessions)
    return trajectories, engine, sandbox


def expected_record(tokenizer, pieces):
    """(response_ids, loss_mask, logprobs) of ("model", text) / ("tool", ids) pieces in order."""
    ids, mask, logprobs = [], [], []
    for kind, value in pieces:
        piece = encode_text(tokenizer, value) if kind == "model" else value
        sampled = sum(mask)
        ids += piece
        mask += [int(kind == "model")] * len(piece)
        logprobs += [logprob(sampled + i) if kind == "model" else 0.0 for i in range(len(piece))]
    return ids, mask, logprobs


def test_tool_call_then_answer_exact_stream_masks_and_logprobs(tokenizer, verifier):
    script = encode_turns(tokenizer, call_text(), ANSWER)
    (t,), engine, sandbox = run(tokenizer, verifier, [[script]])
    response = tool_response_ids(tokenizer, "1024\n")
    ids, mask, logprobs = expected_record(tokenizer, [("model", call_text()), ("tool", response),
                                                      ("model", ANSWER)])
    assert isinstance(t, Trajectory)
    assert t.problem_id == "p0" and t.prompt_ids == render_prompt_ids(tokenizer, PROBLEM.problem)
    assert (t.response_ids, t.loss_mask, t.logprobs) == (ids, mask, logprobs)
    assert engine.sessions[0].appended == [response]
    assert sandbox.calls == [("print(2 ** 10)", "", RolloutConfig().tool_timeout)]
    assert t.tool_outcomes == ["ok"] and t.num_turns == 2 and t.num_answer_blocks == 1
    assert (t.answer, t.reward, t.truncated) == ("1024", 1.0, False)
    assert set(t.timings) == {"queue", "generate", "tool", "verify"}
    assert all(seconds >= 0 for seconds in t.timings.values())
    assert engine.opened[0]["prompt_ids"] == t.prompt_ids
    assert engine.opened[0]["max_tokens"] == RolloutConfig().max_response_length


def test_parse_errors_are_fed_back_and_nothing_runs(tokenizer, verifier):
    bodies = ['{"name": "x", "arguments": {', call_text(name="shell"), call_text(code="")]
    turns = [" Try.</reason>\n<tool_call>\n" + bodies[0] + "\n</tool_call>", bodies[1], bodies[2], ANSWER]
    script = encode_turns(tokenizer, *turns)
    (t,), engine, sandbox = run(tokenizer, verifier, [[script]])
    assert sandbox.calls == []
    assert t.tool_outcomes == ["parse_error"] * 3 and t.num_turns == 4 and t.reward == 1.0
    messages = [parse_tool_call(turn.split("<tool_call>")[1].split("</tool_call>")[0]).message
                for turn in turns[:3]]
    assert "not valid JSON" in messages[0] and "unknown tool 'shell'" in messages[1]
    assert "'code' must be a non-empty string" in messages[2]
    assert engine.sessions[0].appended == [tool_response_ids(tokenizer, m) for m in messages]


def test_a_session_the_server_closed_is_an_infrastructure_outcome():
    closed = SandboxResult("killed", "", "sandbox: session 'x' was closed\n", None, "SessionClosed", 0)
    assert tool_outcome(closed) == "internal"
    assert tool_outcome(SandboxResult("killed", "", "", -9, "SIGKILL", 0.1)) == "killed"  # the code's own


def test_sandbox_statuses_are_shown_to_the_model(tokenizer, verifier):
    results = {
        "boom()": SandboxResult("error", "", "NameError: name 'boom' is not defined\n", 1, "NameError", 0.1),
        "while True: pass": SandboxResult("timeout", "", "", None, None, 10.0),
        "import os; os.abort()": SandboxResult("killed", "", "", -6, "SIGABRT", 0.1),
    }
    turns = [call_text(code) for code in results] + [ANSWER]
    (t,), engine, sandbox = run(tokenizer, verifier, [[encode_turns(tokenizer, *turns)]],
                                sandbox=ScriptedSandbox(results))
    assert t.tool_outcomes == ["error", "timeout", "killed"]
    assert [tool_outcome(r) for r in results.values()] == t.tool_outcomes
    assert t.num_failed_calls == 3 and t.num_turns == 4 and len(sandbox.calls) == 3
    assert engine.sessions[0].appended == [
        tool_response_ids(tokenizer, format_tool_result(r, RolloutConfig().tool_output_chars))
        for r in results.values()
    ]
    # What the service made up when it could not run a call never reaches the model (tests/agent/
    # test_outage.py); its outcome names, were one recorded:
    deadline = SandboxResult.failure("no result before the deadline", error_type="DeadlineExceeded")
    could_not_run = SandboxResult("internal", "", "sandbox: could not start the call\n", None, None, 0.0)
    assert [tool_outcome(deadline), tool_outcome(could_not_run)] == ["unreachable", "internal"]


def test_long_tool_output_keeps_head_and_tail(tokenizer, verifier):
    stdout = "HEAD" + "x" * 5000 + "TAIL\n"
    sandbox = ScriptedSandbox({"print(2 ** 10)": ok(stdout)})
    config = RolloutConfig(tool_output_chars=100)
    (t,), engine, _ = run(tokenizer, verifier, [[encode_turns(tokenizer, call_text(), ANSWER)]],
                          sandbox=sandbox, config=config)
    shown = format_tool_result(ok(stdout), 100)
    assert len(shown) == 100 and shown.startswith("HEAD") and shown.endswith("TAIL\n")
    assert engine.sessions[0].appended == [tool_response_ids(tokenizer, shown)]


def test_turn_limit_ends_truncated_without_running_the_last_call(tokenizer, verifier):
    script = encode_turns(tokenizer, call_text("print(1)"), call_text("print(2)"), ANSWER)
    (t,), engine, sandbox = run(tokenizer, verifier, [[script]], config=RolloutConfig(max_turns=2))
    assert [code for code, _, _ in sandbox.calls] == ["print(1)"]
    assert t.truncated and t.num_turns == 2 and t.tool_outcomes == ["ok"] and t.reward == 0.0
    ids, mask, _ = expected_record(tokenizer, [("model", call_text("print(1)")),
                                               ("tool", tool_response_ids(tokenizer, "1024\n")),
                                               ("model", call_text("print(2)"))])
    assert t.response_ids == ids and t.loss_mask == mask
    # One turn allowed: no tool call can be answered at all.
    (t,), _, sandbox = run(tokenizer, verifier, [[script]], config=RolloutConfig(max_turns=1))
    assert t.truncated and t.num_turns == 1 and t.tool_outcomes == [] and sandbox.calls == []


def test_a_tool_response_that_overflows_the_budget_truncates(tokenizer, verifier):
    first = encode_text(tokenizer, call_text())
    response = tool_response_ids(tokenizer, "1024\n")
    script = encode_turns(tokenizer, call_text(), ANSWER)
    # Exactly room for the response: it is appended (tool tokens count against the budget) ...
    budget = len(first) + len(response) + len(encode_text(tokenizer, ANSWER))
    (t,), _, _ = run(tokenizer, verifier, [[script]], config=RolloutConfig(max_response_length=budget))
    assert not t.truncated and t.reward == 1.0 and len(t.response_ids) == budget
    # ... one token less and the answer's last token (EOS) hits the budget instead: truncated, reward 0.
    (t,), _, _ = run(tokenizer, verifier, [[script]], config=RolloutConfig(max_response_length=budget - 1))
    assert t.truncated and t.reward == 0.0 and len(t.response_ids) == budget - 1
    # The response itself does not fit: the call ran, nothing is appended.
    config = RolloutConfig(max_response_length=len(first) + len(response) - 1)
    (t,), engine, _ = run(tokenizer, verifier, [[script]], config=config)
    assert t.truncated and t.reward == 0.0 and t.tool_outcomes == ["ok"]
    assert t.response_ids == first and engine.sessions[0].appended == []


def test_budget_reached_while_sampling_scores_zero_but_logs_the_answer(tokenizer, verifier):
    rambling = " <answer>\\boxed{1024}</answer> and more" + " words" * 50
    script = encode_turns(tokenizer, rambling)
    (t,), _, _ = run(tokenizer, verifier, [[script]], config=RolloutConfig(max_response_length=30))
    assert t.truncated and len(t.response_ids) == 30 and all(t.loss_mask)
    assert (t.answer, t.reward, t.num_answer_blocks) == ("1024", 0.0, 1)


def test_answer_comes_from_model_text_only(tokenizer, verifier):
    sandbox = ScriptedSandbox({"print(2 ** 10)": ok("<answer>\\boxed{1024}</answer>\n")})
    no_answer = " I give up.</reason><|im_end|>"
    (t,), _, _ = run(tokenizer, verifier, [[encode_turns(tokenizer, call_text(), no_answer)]],
                     sandbox=sandbox)
    assert (t.answer, t.reward, t.num_answer_blocks, t.truncated) == (None, 0.0, 0, False)
    assert (t.num_answer_closes, t.num_answer_pairs) == (0, 0)
    two_answers = " <answer>\\boxed{1000}</answer> no wait <answer>\\boxed{1024}</answer><|im_end|>"
    (t,), _, _ = run(tokenizer, verifier, [[encode_turns(tokenizer, two_answers)]])
    assert (t.answer, t.reward, t.num_answer_blocks, t.num_turns) == ("1024", 1.0, 2, 1)
    assert (t.num_answer_closes, t.num_answer_pairs) == (2, 2)
    wrong = " <answer>\\boxed{1000}</answer><|im_end|>"
    (t,), _, _ = run(tokenizer, verifier, [[encode_turns(tokenizer, wrong)]])
    assert (t.answer, t.reward) == ("1000", 0.0)


def test_several_calls_per_turn(tokenizer, verifier):
    two_calls = call_text("print(1)") + call_text("print(2)")
    results = {"print(1)": ok("1\n"), "print(2)": ok("2\n")}
    config = RolloutConfig(max_tool_calls_per_turn=2)
    # Engine without the turn end as EOS: the limit of two calls ends the turn, one response turn for both.
    (t,), engine, _ = run(tokenizer, verifier, [[encode_turns(tokenizer, two_calls, ANSWER)]],
                          sandbox=ScriptedSandbox(results), config=config, eos=("<|endoftext|>",))
    assert t.tool_outcomes == ["ok", "ok"] and t.num_turns == 2 and t.reward == 1.0
    assert engine.sessions[0].appended == [tool_response_ids(tokenizer, ["1\n", "2\n"])]
    # One call, then the model closes its turn: the session pauses there and the results follow it.
    closed = call_text("print(1)") + "<|im_end|>"
    (t,), engine, _ = run(tokenizer, verifier, [[encode_turns(tokenizer, closed, ANSWER)]],
                          sandbox=ScriptedSandbox(results), config=config, eos=("<|endoftext|>",))
    assert engine.sessions[0].appended == [tool_response_ids(tokenizer, "1\n", turn_closed=True)]
    assert t.num_turns == 2 and t.reward == 1.0
    ids = t.prompt_ids + t.response_ids
    assert tokenizer.decode(ids).count("<|im_end|>") == tokenizer.decode(t.prompt_ids).count("<|im_end|>") + 3
    # With the turn end as engine EOS the session finishes there: the call ran and is recorded, no reply.
    (t,), engine, _ = run(tokenizer, verifier, [[encode_turns(tokenizer, closed)]],
                          sandbox=ScriptedSandbox(results), config=config)
    assert t.tool_outcomes == ["ok"] and engine.sessions[0].appended == [] and not t.truncated


def test_unterminated_call_at_turn_end_is_a_parse_error(tokenizer, verifier):
    broken = ' Try.</reason>\n<tool_call>\n{"name": "x"}<|im_end|>'
    (t,), engine, sandbox = run(tokenizer, verifier, [[encode_turns(tokenizer, broken)]])
    assert t.tool_outcomes == ["parse_error"] and sandbox.calls == [] and not t.truncated


def test_groups_order_seeds_and_sampling(tokenizer, verifier):
    problems = [PROBLEM, Problem(id="p1", problem="What is 1000 + 24?", answer="1024")]
    wrong = " <answer>\\boxed{7}</answer><|im_end|>"
    scripts = [[encode_turns(tokenizer, turn) for turn in (ANSWER, wrong, ANSWER)],
               [encode_turns(tokenizer, call_text(), ANSWER)] * 3]
    sampling = SamplingParams(temperature=0.7, top_p=0.9)
    config = RolloutConfig(seed=5, sampling=sampling)
    trajectories, engine, _ = run(tokenizer, verifier, scripts, config=config, problems=problems)
    assert [t.problem_id for t in trajectories] == ["p0"] * 3 + ["p1"] * 3
    assert [t.reward for t in trajectories] == [1.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    assert [o["n"] for o in engine.opened] == [3, 3] and all(o["sampling"] == sampling for o in engine.opened)
    seeds = [o["seed"] for o in engine.opened]
    assert seeds[0] != seeds[1]
    _, again, _ = run(tokenizer, verifier, scripts, config=config, problems=problems)
    assert [o["seed"] for o in again.opened] == seeds
    _, unseeded, _ = run(tokenizer, verifier, scripts, problems=problems)
    assert [o["seed"] for o in unseeded.opened] == [None, None]


def test_tool_calls_of_different_sessions_overlap(tokenizer, verifier):
    scripts = [[encode_turns(tokenizer, call_text(), ANSWER)] * 8]
    sandbox = ScriptedSandbox(delay=0.05)
    trajectories, _, _ = run(tokenizer, verifier, scripts, sandbox=sandbox)
    assert len(sandbox.calls) == 8 and sandbox.max_in_flight == 8
    assert all(t.reward == 1.0 and t.timings["tool"] > 0 for t in trajectories)


def test_sync_rollout_runs_inside_a_running_loop(tokenizer, verifier):
    engine = ScriptedEngine([[encode_turns(tokenizer, call_text(), ANSWER)] * 2], [2])
    sandbox = ScriptedSandbox()

    async def notebook_cell():  # Jupyter runs cells inside an event loop
        return rollout([PROBLEM], 2, engine=engine, sandbox=sandbox, tokenizer=tokenizer, verifier=verifier)

    trajectories = asyncio.run(notebook_cell())
    assert [t.reward for t in trajectories] == [1.0, 1.0] and not engine.running


def test_bad_input_is_named(tokenizer, verifier):
    for bad, message in ((dict(max_turns=0), "max_turns"), (dict(tool_timeout=0), "tool_timeout"),
                         (dict(max_response_length=2.5), "max_response_length"), (dict(seed="1"), "seed")):
        with pytest.raises(ValueError, match=message):
            RolloutConfig(**bad)
    with pytest.raises(TypeError, match="sampling must be a SamplingParams"):
        RolloutConfig(sampling=dict(temperature=1.0))
    script = [[encode_turns(tokenizer, ANSWER)]]
    with pytest.raises(TypeError, match=r"problems\[0\] is a dict"):
        run(tokenizer, verifier, script, problems=[dataclasses.asdict(PROBLEM)])
    with pytest.raises(ValueError, match="samples_per_problem"):
        asyncio.run(rollout_async([PROBLEM], 0, engine=ScriptedEngine(script, [2]), sandbox=ScriptedSandbox(),
                                  tokenizer=tokenizer, verifier=verifier))

    class TooSmall(ScriptedEngine):
        async def open(self, prompt_ids, n=1, **kwargs):
            raise ValueError("prompt (400 tokens) + max_tokens (8192) exceeds the slot capacity")

    with pytest.raises(ValueError, match="problem 'p0': prompt .* exceeds"):
        asyncio.run(rollout_async([PROBLEM], 1, engine=TooSmall(script, [2]), sandbox=ScriptedSandbox(),
                                  tokenizer=tokenizer, verifier=verifier))


def test_a_failing_sandbox_stops_every_session_and_closes_it(tokenizer, verifier):
    class Broken(ScriptedSandbox):
        async def run(self, code, stdin="", timeout=None):
            if code == "print(1)":
                raise RuntimeError("SandboxClient is closed")
            return await super().run(code, stdin, timeout)

    scripts = [[encode_turns(tokenizer, call_text("print(1)"), ANSWER),
                encode_turns(tokenizer, call_text("print(2)"), ANSWER)]]
    engine = ScriptedEngine(scripts, [2])
    with pytest.raises(RuntimeError, match="SandboxClient is closed"):
        asyncio.run(rollout_async([PROBLEM], 2, engine=engine, sandbox=Broken(delay=0.2), tokenizer=tokenizer,
                                  verifier=verifier))
    assert len(engine.sessions) == 2 and all(s.closed for s in engine.sessions)


def test_prompt_config_is_used(tokenizer, verifier):
    prompt = PromptConfig(system_prompt="Be brief.", user_prefix="Q: ")
    (t,), engine, _ = run(tokenizer, verifier, [[encode_turns(tokenizer, call_text(), ANSWER)]],
                          config=RolloutConfig(prompt=prompt))
    assert t.prompt_ids == render_prompt_ids(tokenizer, PROBLEM.problem, prompt)
    assert engine.sessions[0].appended == [tool_response_ids(tokenizer, "1024\n", prompt)]


def test_a_dead_sandbox_server_stops_the_rollout_at_its_outage_budget_not_a_hang(tokenizer, verifier):
    with socket.socket() as probe:  # a loopback port nobody listens on
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}"

    async def run():
        async with SandboxClient(url, deadline_slack=0.5, backoff=(0.05, 0.2)) as client:
            engine = ScriptedEngine([[encode_turns(tokenizer, call_text(), ANSWER)]], [2])
            return await rollout_async([PROBLEM], 1, engine=engine, sandbox=client, tokenizer=tokenizer,
                                       verifier=verifier, config=RolloutConfig(tool_timeout=0.5),
                                       outage=OutagePolicy(budget_s=0.5, backoff=(0.05, 0.2)))

    with pytest.raises(SandboxUnavailable, match=f"^the sandbox {url} did not answer for "):
        asyncio.run(asyncio.wait_for(run(), 60))


def test_a_budget_stops_mid_turn_and_the_rollout_resumes_where_it_stopped(tokenizer, verifier):
    """Partial rollouts on scripted streams: the token budget stops the session at a segment boundary in the
    middle of its first turn; resumed (a new session on prompt + response so far, with the turn's unparsed
    text kept), it runs the tool call and answers: the same record as an uninterrupted rollout."""
    script = encode_turns(tokenizer, call_text(), ANSWER)
    config = RolloutConfig(segment_tokens=4, seed=5)
    (whole,), _, _ = run(tokenizer, verifier, [[script]], config=config)

    engine = ScriptedEngine([[script]], [encode_text(tokenizer, "<|im_end|>")[0]])
    (partial,) = asyncio.run(rollout_async(
        [PROBLEM], 1, engine=engine, sandbox=ScriptedSandbox(), tokenizer=tokenizer, verifier=verifier,
        config=config, token_budget=6))
    assert isinstance(partial, PartialRollout) and partial.problem_id == "p0"
    assert partial.num_tokens == 8 and partial.conversation.response_ids == script[:8]  # two segments
    assert partial.unparsed == tokenizer.decode(script[:8]) and engine.sessions[0].closed
    assert partial.policy_versions is None  # the scripted engine records no versions

    engine.scripts.append([script[8:]])
    sandbox = ScriptedSandbox()
    (t,) = asyncio.run(rollout_async(
        [], 1, engine=engine, sandbox=sandbox, tokenizer=tokenizer, verifier=verifier, config=config,
        resume=[partial]))
    prompt = render_prompt_ids(tokenizer, PROBLEM.problem)
    assert engine.opened[1]["prompt_ids"] == prompt + script[:8]
    assert engine.opened[1]["max_tokens"] == config.max_response_length - 8 and engine.opened[1]["n"] == 1
    assert (t.response_ids, t.loss_mask, t.tool_outcomes) == (whole.response_ids, whole.loss_mask, ["ok"])
    assert (t.answer, t.reward, t.num_turns) == (whole.answer, whole.reward, whole.num_turns)
    assert (t.answer, t.reward, t.num_turns) == ("1024", 1.0, 2)
    assert t.logprobs[:8] == whole.logprobs[:8] and len(sandbox.calls) == 1

    with pytest.raises(ValueError, match="token_budget must be a positive int"):
        asyncio.run(rollout_async([PROBLEM], 1, engine=engine, sandbox=sandbox, tokenizer=tokenizer,
                                  config=config, token_budget=0))
    with pytest.raises(ValueError, match="stateful_tool"):
        asyncio.run(rollout_async([PROBLEM], 1, engine=engine, sandbox=sandbox, tokenizer=tokenizer,
                                  config=dataclasses.replace(config, stateful_tool=True), token_budget=5))
