"""SFT conversations with real tool outputs (failing-then-fixed share), and the assistant-only loss mask."""

import copy
import functools
import json
import pathlib
import random
import re
import subprocess
import sys

import pytest

from rstar2jax.data.chat_template import CHATML_TOOLS_TEMPLATE, render_chat, tokenize_conversation
from rstar2jax.data.conversation import (
    DEFAULT_USER_PREFIX,
    PromptConfig,
    prompt_messages,
    render_prompt_ids,
    render_prompt_text,
    tool_response_text,
)
from rstar2jax.data.sft_data import (
    BUG_KINDS,
    SFTExample,
    build_sft_examples,
    inject_bug,
    load_sft_sequences,
    sft_rows,
)
from rstar2jax.data.synthetic import make_task
from rstar2jax.data.tokenizer import train_tiny_tokenizer
from rstar2jax.data.tool_result import format_tool_result

CFG = PromptConfig()
FORMAT = functools.partial(format_tool_result, max_chars=1000)
# The exception each bug must really raise (missing_print raises nothing and prints nothing).
EXPECTED_ERROR = {
    "name_error": "NameError",
    "syntax_error": "SyntaxError",
    "type_error": "TypeError",
    "missing_import": "NameError: name 'math' is not defined",
}


def run_code(code: str, stdin: str) -> dict:
    """A minimal local sandbox: a fresh interpreter per call (site skipped for a fast start)."""
    try:
        done = subprocess.run(
            [sys.executable, "-S", "-c", code], input=stdin, capture_output=True, text=True, timeout=20
        )
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "stdout": "", "stderr": ""}
    return {"status": "ok" if done.returncode == 0 else "error", "stdout": done.stdout, "stderr": done.stderr}


def _build(problems, **kwargs) -> list[SFTExample]:
    kwargs = {
        "format_tool_output": FORMAT,
        "prompt": CFG,
        "max_workers": 2,
        **kwargs,
    }
    return build_sft_examples(problems, run_code, **kwargs)


def _calls(messages):
    return [m["tool_calls"][0]["function"]["arguments"]["code"] for m in messages if m.get("tool_calls")]


@pytest.fixture(scope="module")
def problems():
    return make_task(40, 0, seed=5, difficulty=(1, 2)).train


@pytest.fixture(scope="module")
def examples(problems):
    return _build(problems, fail_rate=0.25, seed=1)


@pytest.fixture(scope="module")
def qwen3(qwen3_tokenizer):
    return qwen3_tokenizer


def test_failing_then_fixed_share_with_real_outputs(problems, examples):
    assert [e.problem_id for e in examples] == [p.id for p in problems]
    failing = [e for e in examples if e.bug_kind is not None]
    assert len(failing) == 10  # exactly round(0.25 * 40)
    assert {e.bug_kind for e in failing} <= set(EXPECTED_ERROR)
    for problem, example in zip(problems, examples, strict=True):
        roles = [m["role"] for m in example.messages]
        calls = 1 + (example.bug_kind is not None)
        assert roles == ["system", "user"] + ["assistant", "tool"] * calls + ["assistant"]
        assert example.messages[1]["content"] == CFG.user_prefix + problem.problem
        codes = _calls(example.messages)
        assert codes[-1] == problem.solution
        tool_texts = [m["content"] for m in example.messages if m["role"] == "tool"]
        # Real outputs: running the same code again gives the same tool text.
        assert tool_texts == [FORMAT(run_code(code, "")) for code in codes]
        assert tool_texts[-1] == problem.answer + "\n"
        final = example.messages[-1]["content"]
        assert final.endswith(f"<answer>The answer is \\boxed{{{problem.answer}}}.</answer>")
        if example.bug_kind is not None:
            assert codes[0] != problem.solution
            assert (
                tool_texts[0].startswith("status: error")
                and EXPECTED_ERROR[example.bug_kind] in tool_texts[0]
            )
            error_line = tool_texts[0].strip().splitlines()[-1]
            assert (
                example.messages[4]["content"] == f"<reason>The code raised {error_line}. "
                "I will fix it and run it again.</reason>"
            )


def test_every_bug_kind_really_fails():
    rng = random.Random(0)
    for problem in make_task(10, 0, seed=2).train:  # one per family
        for kind in BUG_KINDS:
            code = inject_bug(problem.solution, kind, rng)
            if code is None:
                assert kind == "missing_import" and "import math" not in problem.solution
                continue
            result = run_code(code, "")
            if kind == "missing_print":
                assert result == {"status": "ok", "stdout": "", "stderr": ""}
            else:
                assert result["status"] == "error" and EXPECTED_ERROR[kind] in result["stderr"], (kind, code)
    with pytest.raises(ValueError, match="unknown bug kind"):
        inject_bug("print(1)", "off_by_one", rng)


def test_missing_print_is_fixed_by_printing(problems):
    examples = _build(problems[:4], fail_rate=1.0, bug_kinds=["missing_print"])
    for example in examples:
        assert example.bug_kind == "missing_print"
        assert example.messages[3]["content"] == "(no output)"
        assert "printed nothing" in example.messages[4]["content"]


def test_deterministic_and_validated(problems, examples):
    assert _build(problems, fail_rate=0.25, seed=1) == examples
    with pytest.raises(ValueError, match="fail_rate"):
        _build(problems, fail_rate=1.5)
    with pytest.raises(ValueError, match="bug_kinds"):
        _build(problems, bug_kinds=["off_by_one"])
    no_import = [p for p in problems if "import math" not in p.solution][:3]
    with pytest.raises(ValueError, match="admit one of"):
        _build(no_import, fail_rate=1.0, bug_kinds=["missing_import"])


def test_a_sandbox_that_disagrees_is_an_error(problems):
    def lying(code, stdin):
        return {"status": "ok", "stdout": "42\n", "stderr": ""}

    with pytest.raises(RuntimeError, match="reference code gave"):
        build_sft_examples(problems[:1], lying, format_tool_output=FORMAT, fail_rate=0.0)
    with pytest.raises(RuntimeError, match="ran cleanly"):
        build_sft_examples(problems[:1], lying, format_tool_output=FORMAT, fail_rate=1.0)


def _masked_runs(tokenizer, ids, mask):
    """Decoded text of each maximal run of mask-1 tokens."""
    runs, current = [], []
    for token, bit in zip(ids, mask, strict=True):
        if bit:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(run) for run in runs]


def _assistant_bodies(messages, opener, end):
    """What the model writes per assistant turn, built by hand: content after the opener, the Hermes call."""
    bodies = []
    for message in messages:
        if message["role"] != "assistant":
            continue
        body = message["content"][len(opener) :]
        for call in message.get("tool_calls", []):
            body += "\n<tool_call>\n" + json.dumps(call["function"], ensure_ascii=False) + "\n</tool_call>"
        bodies.append(body + end)
    return bodies


def _rollout_text(tokenizer, example, problem_text):
    """The token stream a rollout would produce for the same conversation (agent.prompts protocol)."""
    text = render_prompt_text(tokenizer, problem_text, CFG)
    bodies = _assistant_bodies(example.messages, CFG.assistant_opener, tokenizer.eos_token)
    tools = [m["content"] for m in example.messages if m["role"] == "tool"]
    for body, tool in zip(bodies, tools, strict=False):
        text += body + tool_response_text(tokenizer, tool, CFG, turn_closed=True)
    return text + bodies[-1]


@pytest.mark.parametrize("tokenizer_name", ["qwen3", "tiny"])
def test_mask_covers_exactly_the_assistant_turns(tokenizer_name, qwen3, problems, examples, tmp_path):
    if tokenizer_name == "qwen3":
        tokenizer = qwen3
    else:  # a small byte-level BPE with the library's ChatML tools template, as the CPU demo trains
        corpus = [render_chat(qwen3, e.messages, tools=list(CFG.tools)) for e in examples]
        tokenizer = train_tiny_tokenizer(corpus, 600, tmp_path / "tiny", chat_template=CHATML_TOOLS_TEMPLATE)
    for problem, example in zip(problems, examples, strict=True):
        if example.bug_kind is None and problem.family != "gcd":
            continue
        tokenized = tokenize_conversation(
            tokenizer, example.messages, tools=list(CFG.tools), assistant_opener=CFG.assistant_opener
        )
        assert len(tokenized.input_ids) == len(tokenized.loss_mask)
        assert set(tokenized.loss_mask) == {0, 1}
        expected = _assistant_bodies(example.messages, CFG.assistant_opener, tokenizer.eos_token)
        assert _masked_runs(tokenizer, tokenized.input_ids, tokenized.loss_mask) == expected
        # Token for token what a rollout of the same conversation would hold (no Qwen3 <think> quirk).
        rollout = _rollout_text(tokenizer, example, problem.problem)
        assert tokenizer.decode(tokenized.input_ids) == rollout
        if tokenizer_name == "qwen3":
            assert "<think>" not in rollout


# A ChatML template that marks assistant turns with {% generation %} (no tools block, for brevity).
GENERATION_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{% generation %}{{- message.content }}"
    "{%- for call in (message.tool_calls or []) %}"
    "{{- '\\n<tool_call>\\n' + (call.function | tojson) + '\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_generation_tag_templates_use_the_hf_mask(qwen3, examples):
    example = next(e for e in examples if e.bug_kind is not None)
    tagged, plain = copy.copy(qwen3), copy.copy(qwen3)  # share the vocabulary, swap the template
    tagged.chat_template = GENERATION_TEMPLATE
    plain.chat_template = re.sub(r"\{% (end)?generation %\}", "", GENERATION_TEMPLATE)
    for opener in ("", CFG.assistant_opener):
        with_tags = tokenize_conversation(tagged, example.messages, assistant_opener=opener)
        expected = _assistant_bodies(example.messages, opener, "<|im_end|>")
        assert _masked_runs(tagged, with_tags.input_ids, with_tags.loss_mask) == expected
        # The incremental path on the same template agrees token for token.
        assert tokenize_conversation(plain, example.messages, assistant_opener=opener) == with_tags


def test_tokenize_rejects_bad_conversations(qwen3, examples):
    messages = examples[0].messages
    with pytest.raises(ValueError, match="must end with an assistant turn"):
        tokenize_conversation(qwen3, messages[:-1])
    with pytest.raises(ValueError, match="does not start with the opener"):
        tokenize_conversation(qwen3, messages, assistant_opener="<think>")


SHIPPED = pathlib.Path(__file__).resolve().parents[2] / "experiments" / "data" / "sft_tool_use.jsonl"


def test_rows_carry_the_prompt_rollouts_use(examples):
    """An SFT row holds the tool schemas and opener of the prompt it was written in."""
    demo_prompt = PromptConfig(system_prompt="", user_prefix="", list_tools=False)
    for prompt in (CFG, demo_prompt):
        (row,) = sft_rows(examples[:1], prompt)
        assert row["tools"] == prompt.listed_tools and row["assistant_opener"] == prompt.assistant_opener
    problem = examples[0].messages[1]["content"].removeprefix(CFG.user_prefix)
    assert examples[0].messages[:2] == prompt_messages(problem)


def test_shipped_sft_data_is_in_the_rl_prompt_and_tokenizes(qwen3):
    """experiments/data/sft_tool_use.jsonl: 128 conversations written in the prompt RL rollouts use by default
    (the same system and user turns, tool schemas and opener), every one tokenising with the loss on the
    assistant turns; the tokens before the first assistant content are exactly the rollout's prompt."""
    rows = [json.loads(line) for line in SHIPPED.read_text(encoding="utf-8").splitlines()]
    assert len(rows) == 128 and SHIPPED.stat().st_size < 400_000
    fixed = 0
    for row in rows:
        problem = row["messages"][1]["content"].removeprefix(DEFAULT_USER_PREFIX)
        assert row["messages"][:2] == prompt_messages(problem, CFG)
        assert row["tools"] == CFG.listed_tools and row["assistant_opener"] == CFG.assistant_opener
        assert row["messages"][-1]["content"].endswith("</answer>")
        fixed += sum(bool(m.get("tool_calls")) for m in row["messages"]) == 2
    assert 30 <= fixed <= 60  # about a third first call broken code, then fix it
    sequences, skipped = load_sft_sequences(SHIPPED, qwen3)
    assert skipped == 0 and len(sequences) == 128
    for row, sequence in list(zip(rows, sequences, strict=True))[:8]:
        prompt_ids = render_prompt_ids(qwen3, row["messages"][1]["content"].removeprefix(DEFAULT_USER_PREFIX))
        assert list(sequence.tokens[: len(prompt_ids)]) == prompt_ids
        assert not any(sequence.loss_mask[: len(prompt_ids)]) and sequence.loss_mask[len(prompt_ids)] == 1
