"""The conversation format travels with the policy: an exported policy is served in the format recorded in its
folder, a plain HF folder with its chat template and nothing appended, ServerConfig overrides either; and
``max_tokens=N`` ends with "length" after exactly N completion tokens (the official ``openai`` client)."""

import dataclasses

import openai
import pytest

from experiments.tiny_policy import HELLO, HELLO_ANSWER
from rstar2jax.data.conversation import PROMPTS, PromptConfig, encode_text, prompt_format, render_chat
from rstar2jax.serve import BackgroundServer, ChatService, ServerConfig, load_policy, parse_chat_request
from tests.serve.conftest import SERVER_CONFIG

HELLO_MESSAGES = [{"role": "user", "content": HELLO}]


@pytest.fixture(scope="module")
def plain_policy(plain_policy_dir):
    return load_policy(plain_policy_dir)


@pytest.fixture(scope="module")
def plain_server(plain_policy):
    with BackgroundServer(plain_policy, SERVER_CONFIG) as live:
        yield live


def openai_client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_loaded_policy_brings_its_recorded_format(tiny_policy, plain_policy):
    assert tiny_policy.prompt == PromptConfig(system_prompt="")  # what build_tiny_policy taught and recorded
    assert plain_policy.prompt is None
    # evaluate and chat: the recorded format, else plain; a preset and single fields replace it
    assert prompt_format(tiny_policy) == tiny_policy.prompt
    assert prompt_format(plain_policy) == PROMPTS["plain"]() == PromptConfig(assistant_opener="")
    assert prompt_format(plain_policy, "bare", assistant_opener="<think>") == PromptConfig(
        system_prompt="", user_prefix="", list_tools=False, assistant_opener="<think>"
    )
    assert prompt_format(tiny_policy, system_prompt="S", user_prefix="") == PromptConfig(
        system_prompt="S", user_prefix=""
    )
    with pytest.raises(ValueError, match="prompt format 'papr'"):
        prompt_format(tiny_policy, "papr")


def test_the_server_renders_the_policys_format_and_config_overrides_it(tiny_policy, plain_policy):
    tokenizer = tiny_policy.tokenizer

    def prompt_ids(policy, messages=HELLO_MESSAGES, **config):
        service = ChatService(policy, ServerConfig(num_slots=2, max_len=512, warmup=False, **config))
        return service.prompt_ids(parse_chat_request({"messages": messages}, max_n=2))

    def rendered(messages, opener=""):
        return encode_text(tokenizer, render_chat(tokenizer, messages, add_generation_prompt=True) + opener)

    system = [{"role": "system", "content": "Be brief."}]
    assert prompt_ids(tiny_policy) == rendered(HELLO_MESSAGES, "<reason>")  # recorded: no system text
    assert prompt_ids(plain_policy) == rendered(HELLO_MESSAGES)  # plain: the template alone
    assert prompt_ids(tiny_policy, assistant_opener="", system_prompt="Be brief.") == rendered(
        system + HELLO_MESSAGES
    )
    assert prompt_ids(plain_policy, assistant_opener="<reason>") == rendered(HELLO_MESSAGES, "<reason>")
    own = [{"role": "system", "content": "Mine."}, *HELLO_MESSAGES]  # a request's own system message stays
    assert prompt_ids(plain_policy, own, system_prompt="Be brief.") == rendered(own)
    with_system = dataclasses.replace(tiny_policy, prompt=PromptConfig(system_prompt="Be brief."))
    assert prompt_ids(with_system) == rendered(system + HELLO_MESSAGES, "<reason>")  # recorded system text


def test_a_plain_folder_is_served_without_an_opener(plain_server, plain_policy):
    """The content is the model's own tokens from the first one on: nothing is put before them, and the
    prompt is the chat template's rendering with nothing after the generation prompt."""
    response = openai_client(plain_server).chat.completions.create(
        model=plain_policy.name, messages=HELLO_MESSAGES, temperature=0, max_tokens=12, logprobs=True
    )
    choice = response.choices[0]
    tokens = [entry.token for entry in choice.logprobs.content]
    assert "".join(tokens) == choice.message.content and len(tokens) == 12
    assert not choice.message.content.startswith("<reason>")
    tokenizer = plain_policy.tokenizer
    expected = encode_text(tokenizer, render_chat(tokenizer, HELLO_MESSAGES, add_generation_prompt=True))
    assert response.usage.prompt_tokens == len(expected)


def test_an_exported_policy_is_served_with_its_recorded_opener(server, tiny_policy):
    response = openai_client(server).chat.completions.create(
        model=tiny_policy.name, messages=HELLO_MESSAGES, temperature=0
    )
    assert response.choices[0].message.content == HELLO_ANSWER  # the opener, then the taught reply
    assert HELLO_ANSWER.startswith(tiny_policy.prompt.assistant_opener)


@pytest.mark.parametrize("which", ["server", "plain_server"])
@pytest.mark.parametrize("max_tokens", [1, 2, 5])
def test_max_tokens_ends_with_length_after_exactly_n_tokens(request, which, max_tokens):
    """Greedy replies are longer than 5 tokens, so each stops at its budget: "length", and the usage and the
    log-prob entries count exactly the budget's tokens, streamed or not."""
    live = request.getfixturevalue(which)
    client = openai_client(live)
    model = client.models.list().data[0].id
    kwargs = dict(model=model, messages=HELLO_MESSAGES, temperature=0, max_tokens=max_tokens, logprobs=True)
    whole = client.chat.completions.create(**kwargs)
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and whole.usage.completion_tokens == max_tokens
    assert len(choice.logprobs.content) == max_tokens
    stream = client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    chunks = list(stream)
    deltas = [c.choices[0] for c in chunks if c.choices]
    finishes = [d.finish_reason for d in deltas if d.finish_reason]
    entries = [e for d in deltas if d.logprobs for e in d.logprobs.content]
    assert finishes == ["length"] and chunks[-1].usage.completion_tokens == max_tokens
    assert len(entries) == max_tokens
    assert "".join(d.delta.content or "" for d in deltas) == choice.message.content
