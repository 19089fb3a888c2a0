"""Tools and rewards as plug-ins: a function tool beside the Python tool in one rollout (scripted engine and
sandbox of ``test_rollout``), bad arguments, a tool that raises or hangs, tools named in a config, the chat's
display of any tool, and a reward function in place of the answer verifier."""

import asyncio
import io
import json
import sys

import pytest

from experiments import _launch
from rstar2jax.agent import (
    PYTHON_TOOL_NAME,
    FunctionTool,
    PromptConfig,
    PythonTool,
    RolloutConfig,
    load_tool,
    load_tools,
    python_tool_schema,
    rollout_async,
    tool_response_ids,
)
from rstar2jax.agent.tools import rollout_tools
from rstar2jax.data.chat_template import encode_text
from rstar2jax.data.problems import Problem
from rstar2jax.data.tokenizer import train_tiny_tokenizer
from rstar2jax.data.tool_parser import FunctionCall
from rstar2jax.data.tool_result import format_tool_result
from rstar2jax.reward import AnswerVerifier, RewardError
from rstar2jax.serve.chat import TerminalObserver
from tests.agent import plugins
from tests.agent.test_rollout import ANSWER, PROBLEM, ScriptedEngine, ScriptedSandbox, call_text, encode_turns

ADD = "tests.agent.plugins:add"
PLUGINS = "tests.agent.plugins:"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    corpus = [PROBLEM.problem, call_text(), ANSWER, "Answer: Paris", "Answer: Tokyo"] * 5
    return train_tiny_tokenizer(corpus, vocab_size=320, out_dir=tmp_path_factory.mktemp("tools_tokenizer"))


@pytest.fixture(scope="module")
def verifier():
    with AnswerVerifier(num_workers=1) as answer_verifier:
        yield answer_verifier


def function_call(name, arguments):
    body = json.dumps({"name": name, "arguments": arguments})
    return f" Let me use {name}.</reason>\n<tool_call>\n{body}\n</tool_call>"


def run(tokenizer, verifier, turns, specs, *, config=None, problems=(PROBLEM,), reward=None):
    """One rollout per problem of the scripted ``turns`` (one list per problem) with the tools ``specs``."""
    sandbox = ScriptedSandbox()
    tools, prompt = load_tools(specs, sandbox, PromptConfig())
    config = RolloutConfig(prompt=prompt, **(config or {}))
    engine = ScriptedEngine([[encode_turns(tokenizer, *t)] for t in turns],
                            [encode_text(tokenizer, "<|im_end|>")[0]])
    trajectories = asyncio.run(rollout_async(
        list(problems), 1, engine=engine, sandbox=sandbox, tokenizer=tokenizer, verifier=verifier,
        config=config, tools=tools, reward=reward))
    return trajectories, engine, sandbox, prompt


def test_the_python_tool_and_a_function_tool_side_by_side(tokenizer, verifier):
    turns = [call_text(), function_call("add", {"a": 1000, "b": 24}), ANSWER]
    (t,), engine, sandbox, prompt = run(tokenizer, verifier, [turns], ["python", ADD])
    assert prompt.tool_names == (PYTHON_TOOL_NAME, "add")
    assert sandbox.calls == [("print(2 ** 10)", "", RolloutConfig().tool_timeout)]  # only the Python call
    assert t.tool_outcomes == ["ok", "ok"] and t.num_turns == 3 and t.reward == 1.0
    assert engine.sessions[0].appended == [tool_response_ids(tokenizer, "1024\n", prompt),
                                           tool_response_ids(tokenizer, "1024", prompt)]
    inserted = sum(len(ids) for ids in engine.sessions[0].appended)
    assert t.loss_mask.count(0) == inserted  # tool output is masked, whichever tool wrote it


def test_bad_arguments_raising_and_hanging_tools_are_tool_errors(tokenizer, verifier):
    specs = [ADD] + [PLUGINS + name for name in ("divide", "sleepy", "wait_forever")]
    calls = [("add", {"a": 1, "c": 2}), ("add", {"a": 1, "b": "2"}), ("divide", {"a": 1, "b": 0}),
             ("sleepy", {"seconds": 1.0}), ("wait_forever", {"reason": "x"})]
    turns = [function_call(name, arguments) for name, arguments in calls] + [ANSWER]
    (t,), engine, _, prompt = run(tokenizer, verifier, [turns], specs, config=dict(tool_timeout=0.2))
    assert t.tool_outcomes == ["parse_error", "parse_error", "error", "timeout", "timeout"]
    shown = [tokenizer.decode(ids) for ids in engine.sessions[0].appended]
    assert "unexpected argument(s) ['c']; add takes ['a', 'b']" in shown[0]
    assert "'b' must be of JSON type integer, got '2'" in shown[1]
    assert "ZeroDivisionError: division by zero" in shown[2] and "status: error" in shown[2]
    assert "sleepy did not return within 0.2 s" in shown[3]
    assert "wait_forever did not return within 0.2 s" in shown[4]
    assert t.num_failed_calls == 5  # what the RoC tool-error penalty reads


def test_a_function_tool_has_the_schema_of_its_signature_and_docstring():
    tool = load_tool(ADD)
    assert isinstance(tool, FunctionTool) and tool.name == "add"
    assert tool.schema["function"]["parameters"] == {
        "type": "object", "required": ["a", "b"],
        "properties": {"a": {"type": "integer", "description": "the first addend"},
                       "b": {"type": "integer", "description": "the second addend"}}}
    assert tool.check({"a": 1, "b": 2}) is None and "missing argument(s) ['b']" in tool.check({"a": 1})
    assert "JSON type integer, got True" in tool.check({"a": True, "b": 2})

    def undocumented(x: int) -> int:
        return x

    with pytest.raises(ValueError, match="no schema from its signature and docstring"):
        FunctionTool(undocumented)
    for spec, match in (("nowhere", "'module:function'"), ("tests.agent.plugins:nothing", "nothing"),
                        ("no_such_module:f", "No module named")):
        with pytest.raises(ValueError, match=match):
            load_tool(spec)


def test_python_stays_the_default_and_a_listed_tool_needs_an_implementation():
    sandbox = ScriptedSandbox()
    (python,) = rollout_tools(PromptConfig(), sandbox).values()
    assert python == PythonTool(sandbox) and python.schema == python_tool_schema()
    with pytest.raises(ValueError, match=r"lists tool\(s\) \['add'\] that no tool given implements"):
        rollout_tools(PromptConfig(tools=(python_tool_schema(), load_tool(ADD).schema)), sandbox,
                      [PythonTool(sandbox)])
    with pytest.raises(ValueError, match="two tools are named 'add'"):
        rollout_tools(PromptConfig(tools=()), sandbox, [plugins.add, plugins.add])
    tools, prompt = load_tools([ADD], sandbox, PromptConfig())
    assert prompt.tool_names == ("add",) and [t.name for t in tools] == ["add"]


def test_the_chat_shows_any_tool_call():
    out = io.StringIO()
    observer = TerminalObserver(out=out, color=False)
    observer.on_call(FunctionCall(PYTHON_TOOL_NAME, {"code": "print(1)", "input": ""}))
    observer.on_call(FunctionCall("add", {"a": 1, "b": 2}))
    observer.on_result(FunctionCall("add", {"a": 1, "b": 2}), "ok", format_tool_result({"status": "ok",
                                                                                       "stdout": "3"}, 100))
    assert out.getvalue() == "\n[python]\nprint(1)\n\n[add] {\"a\": 1, \"b\": 2}\n[output: ok]\n3\n"


CAPITALS = [Problem("fr", "What is the capital of France?", "Paris"),
            Problem("jp", "What is the capital of Japan?", "Tokyo")]


def test_a_string_match_reward_replaces_the_answer_verifier(tokenizer, verifier):
    turns = [[" It is in Europe.</reason>\nAnswer: Paris<|im_end|>"],
             [" Maybe Kyoto.</reason>\nAnswer: Kyoto<|im_end|>"]]
    trajectories, *_ = run(tokenizer, verifier, turns, ["python"], problems=CAPITALS,
                           reward="tests.agent.plugins:string_match")
    assert [t.reward for t in trajectories] == [1.0, 0.0]
    assert [t.answer for t in trajectories] == [None, None]  # no \boxed{}: the math answer check would give 0
    assert all("verify" in t.timings for t in trajectories)


@pytest.mark.parametrize("function, match", [
    ("broken_reward", r"reward tests.agent.plugins:broken_reward raised KeyError: 'missing' \(problem 'fr"),
    ("nan_reward", r"reward tests.agent.plugins:nan_reward returned nan for problem 'fr': a reward must be"),
])
def test_a_reward_that_raises_or_returns_no_number_stops_the_rollout(tokenizer, verifier, function, match):
    turns = [[" It is in Europe.</reason>\nAnswer: Paris<|im_end|>"]]
    with pytest.raises(RewardError, match=match):
        run(tokenizer, verifier, turns, ["python"], problems=CAPITALS[:1], reward=PLUGINS + function)


def test_a_reward_error_stops_a_launcher_in_one_line(monkeypatch, capsys):
    def main(argv):
        raise RewardError("reward m:f raised KeyError: 'x' (problem 'p')")

    monkeypatch.setattr(sys, "argv", ["train_rl"])
    with pytest.raises(SystemExit) as stopped:
        _launch.run(main)
    assert stopped.value.code == 3  # a fault that stopped the run, as a sandbox gone for good
    assert capsys.readouterr().err == "error: reward m:f raised KeyError: 'x' (problem 'p')\n"


def test_the_asynchronous_schedules_sessions_have_the_rollouts_tools_and_reward(tokenizer, verifier):
    from rstar2jax.agent import PolicyRollout
    from rstar2jax.engine import EngineConfig

    sandbox = ScriptedSandbox()
    tools, prompt = load_tools(["python", ADD], sandbox, PromptConfig())
    rollout = PolicyRollout(None, tokenizer, sandbox, engine_config=EngineConfig(), max_prompt_length=64,
                            config=RolloutConfig(prompt=prompt), verifier=verifier, tools=tools,
                            reward=PLUGINS + "string_match")
    try:
        sessions = rollout.stream_sessions(None, 64, 2)
        assert list(sessions.tools) == [PYTHON_TOOL_NAME, "add"]
        assert sessions.reward == PLUGINS + "string_match"
    finally:
        rollout.close()


def test_a_registered_tool_is_named_in_a_config(monkeypatch):
    from rstar2jax.agent import TOOLS, register_tool

    monkeypatch.setattr("rstar2jax.agent.tools.TOOLS", dict(TOOLS))  # the registration stays in this test
    register_tool("adder")(plugins.add)
    tool = load_tool("adder")
    assert isinstance(tool, FunctionTool) and tool.name == "add"
    with pytest.raises(ValueError, match="a tool named 'adder' is already registered"):
        register_tool("adder")(plugins.divide)
    with pytest.raises(TypeError, match="a tool must be a Tool or a function, got int"):
        rollout_tools(PromptConfig(tools=()), None, [3])
