"""The paper's prompt and the token-in/token-out tool-response protocol, checked against chat templates."""

import dataclasses
import json
import types

import pytest

from rstar2jax.data.chat_template import encode_text, render_chat
from rstar2jax.data.conversation import (
    DEFAULT_SYSTEM_PROMPT,
    DEFAULT_USER_PREFIX,
    PROMPT_CONFIG_FILE,
    PROMPT_CONFIG_VERSION,
    PYTHON_TOOL_NAME,
    PromptConfig,
    load_prompt_config,
    python_tool_schema,
    render_prompt_ids,
    render_prompt_text,
    tool_response_ids,
    tool_response_text,
)
from rstar2jax.data.tokenizer import train_tiny_tokenizer
from rstar2jax.data.tool_result import format_tool_result

PROBLEM = "Find the remainder when $2^{100}$ is divided by $7$."


@pytest.fixture(scope="module")
def qwen3(qwen3_tokenizer):
    return qwen3_tokenizer


@pytest.fixture(scope="module", params=["qwen3", "tiny"])
def tokenizer(request, tmp_path_factory):
    if request.param == "qwen3":
        return request.getfixturevalue("qwen3")
    corpus = [DEFAULT_SYSTEM_PROMPT, DEFAULT_USER_PREFIX + PROBLEM, "print(pow(2, 100, 7))"] * 10
    return train_tiny_tokenizer(corpus, vocab_size=320, out_dir=tmp_path_factory.mktemp("tiny"))


def test_prompt_is_the_chat_template_rendering_plus_opener(tokenizer):
    text = render_prompt_text(tokenizer, PROBLEM)
    messages = [
        {"role": "system", "content": DEFAULT_SYSTEM_PROMPT},
        {"role": "user", "content": DEFAULT_USER_PREFIX + PROBLEM},
    ]
    expected = tokenizer.apply_chat_template(
        messages, tools=[python_tool_schema()], add_generation_prompt=True, tokenize=False
    )
    assert text == expected + "<reason>"
    assert render_prompt_ids(tokenizer, PROBLEM) == encode_text(tokenizer, text)


def test_prompt_carries_the_paper_pieces(qwen3):
    text = render_prompt_text(qwen3, PROBLEM)
    assert text.startswith("<|im_start|>system\nA conversation between User and Assistant.")
    assert "enclosed within <reason> </reason> and answer is enclosed within <answer> </answer> tags" in text
    assert "# Tools\n" in text and f'"name": "{PYTHON_TOOL_NAME}"' in text
    assert '"required": ["code", "input"]' in text
    assert (
        "<|im_start|>user\nYou must put your answer inside <answer> </answer> tags, i.e., "
        "<answer> answer here </answer>. And your final answer will be extracted automatically by the "
        f"\\boxed{{}} tag.\nThis is the problem:\n{PROBLEM}<|im_end|>\n"
    ) in text
    assert text.endswith("<|im_start|>assistant\n<reason>")


def test_prompt_config_overrides(qwen3):
    cfg = PromptConfig(system_prompt="", user_prefix="Q: ", assistant_opener="", tools=())
    assert (
        render_prompt_text(qwen3, "1+1?", cfg)
        == "<|im_start|>user\nQ: 1+1?<|im_end|>\n<|im_start|>assistant\n"
    )
    thinking_off = PromptConfig(chat_template_kwargs={"enable_thinking": False})
    assert render_prompt_text(qwen3, "1+1?", thinking_off).endswith(
        "assistant\n<think>\n\n</think>\n\n<reason>"
    )
    unlisted = PromptConfig(system_prompt="", user_prefix="Q: ", assistant_opener="", list_tools=False)
    assert render_prompt_text(qwen3, "1+1?", unlisted) == render_prompt_text(qwen3, "1+1?", cfg)
    assert unlisted.tool_names == (PYTHON_TOOL_NAME,) and unlisted.listed_tools is None  # callable, not shown
    renamed = PromptConfig(tools=(python_tool_schema("python_code_with_standard_io"),))
    assert renamed.tool_names == ("python_code_with_standard_io",)
    with pytest.raises(ValueError, match="problem must be a non-empty str"):
        render_prompt_text(qwen3, "")
    with pytest.raises(TypeError, match="tools must be a tuple"):
        PromptConfig(tools=[python_tool_schema()])


def test_tool_response_ids_are_the_templates_tool_turn(qwen3):
    text = tool_response_text(qwen3, "2\n")
    assert text == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n2\n\n</tool_response><|im_end|>\n<|im_start|>assistant\n<reason>"
    )
    ids = tool_response_ids(qwen3, "2\n")
    assert ids[0] == 151645 and ids == encode_text(qwen3, text)
    both = tool_response_text(qwen3, ["a", "b"])
    assert "<tool_response>\na\n</tool_response>\n<tool_response>\nb\n</tool_response><|im_end|>" in both
    closed = tool_response_text(qwen3, "2", turn_closed=True)
    assert closed == text.replace("2\n\n", "2\n")[len("<|im_end|>") :]
    with pytest.raises(ValueError, match="non-empty sequence"):
        tool_response_text(qwen3, [])


def test_token_in_token_out_trajectory_equals_template_rendering(tokenizer):
    """prompt + sampled ids + tool-response ids + ... is the template's rendering of the same conversation.

    Each generated segment starts with a space so that its ids are also the canonical encoding after the
    opener "<reason>"; a model that samples "\\n" there produces a non-canonical split of the same text
    (which is why history is never re-tokenised).
    """
    cfg = PromptConfig()
    generated = [
        ' I will compute it.</reason>\n<tool_call>\n{"name": "x", "arguments": {"code": "print(2**100 % 7)"}}'
        "\n</tool_call>",
        ' Two checks.</reason>\n<tool_call>\n{"a": 1}\n</tool_call>\n<tool_call>\n{"b": 2}\n</tool_call>',
    ]
    tool_outputs = [["2\n"], ["status: error\nstderr:\nNameError", "ok"]]
    ids = render_prompt_ids(tokenizer, PROBLEM, cfg)
    messages = [
        {"role": "system", "content": cfg.system_prompt},
        {"role": "user", "content": cfg.user_prefix + PROBLEM},
    ]
    for text, outputs in zip(generated, tool_outputs, strict=True):
        ids += encode_text(tokenizer, text) + tool_response_ids(tokenizer, outputs, cfg)
        messages.append({"role": "assistant", "content": cfg.assistant_opener + text})
        messages += [{"role": "tool", "content": output} for output in outputs]
    rendered = (
        render_chat(tokenizer, messages, tools=list(cfg.tools), add_generation_prompt=True) + "<reason>"
    )
    assert tokenizer.decode(ids) == rendered
    assert ids == encode_text(tokenizer, rendered)


def test_template_that_alters_tool_content_is_rejected(tmp_path):
    tokenizer = train_tiny_tokenizer(["a b c"], vocab_size=300, out_dir=tmp_path)
    tokenizer.chat_template = tokenizer.chat_template.replace(
        "message.content + '\\n</tool_response>'", "(message.content | trim) + '\\n</tool_response>'"
    )
    assert "message.content | trim" in tokenizer.chat_template
    with pytest.raises(ValueError, match="does not render tool messages verbatim"):
        tool_response_ids(tokenizer, "out")


def test_format_tool_result_labels_and_truncates():
    assert format_tool_result({"status": "ok", "stdout": "2\n", "stderr": ""}, 100) == "2\n"
    assert format_tool_result({"status": "ok", "stdout": "", "stderr": ""}, 100) == "(no output)"
    failed = {"status": "error", "stdout": "partial\n", "stderr": "Traceback ...\nZeroDivisionError"}
    assert format_tool_result(failed, 1000) == (
        "status: error\nstdout:\npartial\n\nstderr:\nTraceback ...\nZeroDivisionError"
    )
    as_object = types.SimpleNamespace(status="timeout", stdout=None, stderr="")
    assert format_tool_result(as_object, 100) == "status: timeout"

    long_output = "".join(f"{i:05d}\n" for i in range(2000))  # 12,000 characters
    for max_chars in (60, 61, 500, 11_999):
        text = format_tool_result({"status": "ok", "stdout": long_output, "stderr": ""}, max_chars)
        assert len(text) == max_chars
        head, marker, tail = text.partition("\n...[")
        omitted = int(marker and tail.split(" characters truncated]")[0])
        tail = tail.split("truncated]...\n", 1)[1]
        assert long_output.startswith(head) and long_output.endswith(tail)
        assert len(head) + omitted + len(tail) == len(long_output)
        assert abs(len(head) - len(tail)) <= 1
    with pytest.raises(ValueError, match="too small to hold the truncation marker"):
        format_tool_result({"status": "ok", "stdout": long_output, "stderr": ""}, 20)
    with pytest.raises(ValueError, match="no 'status'"):
        format_tool_result({"stdout": "x"}, 100)


def test_prompt_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        PromptConfig().assistant_opener = "<think>"


def test_prompt_config_round_trips_through_its_folder_file(tmp_path):
    assert load_prompt_config(tmp_path) is None  # a plain HF folder records no format
    custom = PromptConfig(
        system_prompt="",
        assistant_opener="<think>",
        tools=(python_tool_schema("run"),),
        list_tools=False,
        chat_template_kwargs={"enable_thinking": False},
    )
    for cfg in (PromptConfig(), custom):
        path = cfg.save_pretrained(tmp_path)
        assert path == str(tmp_path / PROMPT_CONFIG_FILE)
        assert json.loads((tmp_path / PROMPT_CONFIG_FILE).read_text())["version"] == PROMPT_CONFIG_VERSION
        assert load_prompt_config(tmp_path) == cfg


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda r: r.update(version=99), "version 99"),
        (lambda r: r.pop("assistant_opener"), r"missing fields \['assistant_opener'\]"),
        (lambda r: r.update(opener="<r>"), r"unknown fields \['opener'\]"),
        (lambda r: r.update(tools=[{"type": "function"}]), "names no function"),
        (lambda r: r.update(system_prompt=3), "system_prompt must be a str"),
        (lambda r: r.update(list_tools="yes"), "list_tools"),
    ],
)
def test_a_bad_format_file_is_an_error_naming_it(tmp_path, edit, message):
    record = PromptConfig().to_json_dict()
    edit(record)
    (tmp_path / PROMPT_CONFIG_FILE).write_text(json.dumps(record))
    with pytest.raises(ValueError, match=message) as error:
        load_prompt_config(tmp_path)
    assert PROMPT_CONFIG_FILE in str(error.value)


def test_a_format_file_that_is_not_json_is_an_error_naming_it(tmp_path):
    (tmp_path / PROMPT_CONFIG_FILE).write_text("{")
    with pytest.raises(ValueError, match=f"{PROMPT_CONFIG_FILE}: not valid JSON"):
        load_prompt_config(tmp_path)


def test_the_chat_template_and_tool_result_names_have_one_home():
    """Rendering chats and tool results live in their own modules, imported from there (the conversation
    module no longer hands them on: re-exports are for package ``__init__`` files only)."""
    from rstar2jax.data import chat_template, conversation, tool_result

    for module, names in (
        (chat_template, ("CHATML_TOOLS_TEMPLATE", "HERMES_TOOL_TOKENS", "TokenizedConversation",
                         "encode_chat", "encode_text", "render_chat", "tokenize_conversation")),
        (tool_result, ("format_tool_result", "truncate_middle")),
    ):
        for name in names:
            value = getattr(module, name)
            assert getattr(value, "__module__", module.__name__) == module.__name__, name
    for name in ("CHATML_TOOLS_TEMPLATE", "HERMES_TOOL_TOKENS", "encode_chat", "tokenize_conversation",
                 "truncate_middle"):
        assert not hasattr(conversation, name), name
