"""A tiny policy folder built offline in seconds, for the tests and the serving benchmark.

``build_tiny_policy(out_dir)`` trains a byte-level BPE tokenizer and teaches a random 2-layer Qwen3-shaped
model (Adam on the next-token loss) three short conversations in the rStar2-Agent format, then saves it as
an HF folder (config.json, safetensors, tokenizer with its chat template):

* "Say hello." -> a plain answer;
* "What is the weather in Paris?" with a ``get_weather`` function tool -> a Hermes ``<tool_call>``, and after
  the tool's answer a final answer that quotes it;
* "What is 6 times 7?" in the paper's prompt (by default without its system text) -> a call of the Python
  tool that prints ``6 * 7``, and after its output ``\\boxed{42}``.

The folder records that format (``rstar2jax_prompt.json``: the ``<reason>`` opener, the paper's user prefix
and listed tool; every conversation has the format's system prompt, none by default), so the launchers
prompt the policy as it was taught without flags.

It exercises every path of ``experiments.evaluate``, ``experiments.chat`` and ``experiments.serve`` with real
tool calls; it knows nothing else.
"""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax

from rstar2jax import models
from rstar2jax.data.chat_template import encode_text, render_chat
from rstar2jax.data.conversation import PYTHON_TOOL_NAME, PromptConfig, render_prompt_text
from rstar2jax.data.tokenizer import train_tiny_tokenizer

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
HELLO = "Say hello."
HELLO_ANSWER = "<reason> A greeting.</reason>\n<answer>Hello there!</answer>"
WEATHER = "What is the weather in Paris?"
WEATHER_CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
WEATHER_RESULT = "sunny, 21 C"
WEATHER_ANSWER = "<reason> The tool says sunny.</reason>\n<answer>It is sunny in Paris.</answer>"
ARITHMETIC = "What is 6 times 7?"
ARITHMETIC_CODE = "print(6 * 7)"
ARITHMETIC_ANSWER = "<reason> It printed 42.</reason>\n<answer>\\boxed{42}</answer>"
OPENER = "<reason>"


def _call_text(call: dict, lead: str) -> str:
    return f"{OPENER}{lead}</reason>\n<tool_call>\n{json.dumps(call)}\n</tool_call>"


def conversations(prompt: PromptConfig) -> list[tuple[list[dict], list | None]]:
    """The taught conversations as (messages, tools); assistant contents start with the opener, and each
    starts with the format's system prompt, as a server prompting in that format renders it."""
    python_call = {"name": PYTHON_TOOL_NAME, "arguments": {"code": ARITHMETIC_CODE, "input": ""}}
    system = [{"role": "system", "content": prompt.system_prompt}] if prompt.system_prompt else []
    return [
        ([*system, {"role": "user", "content": HELLO}, {"role": "assistant", "content": HELLO_ANSWER}], None),
        (
            [
                *system,
                {"role": "user", "content": WEATHER},
                {"role": "assistant", "content": _call_text(WEATHER_CALL, " I will look it up.")},
                {"role": "tool", "content": WEATHER_RESULT},
                {"role": "assistant", "content": WEATHER_ANSWER},
            ],
            [WEATHER_TOOL],
        ),
        (
            [
                *system,
                {"role": "user", "content": prompt.user_prefix + ARITHMETIC},
                {"role": "assistant", "content": _call_text(python_call, " Let me compute it.")},
                {"role": "tool", "content": "42\n"},
                {"role": "assistant", "content": ARITHMETIC_ANSWER},
            ],
            prompt.listed_tools,
        ),
    ]


def build_tiny_policy(
    out_dir: str | pathlib.Path,
    *,
    steps: int = 120,
    hidden_size: int = 64,
    num_layers: int = 2,
    seed: int = 0,
    prompt: PromptConfig | None = None,
) -> pathlib.Path:
    """Builds the tiny policy folder at ``out_dir`` (see the module docstring), taught and recorded in
    ``prompt`` (default: the paper's without its system text); returns its path."""
    out = pathlib.Path(out_dir)
    prompt = prompt or PromptConfig(system_prompt="")
    bootstrap = train_tiny_tokenizer(["x"], 300, out)  # renders the chat template for the corpus
    chats = conversations(prompt)
    texts = [render_chat(bootstrap, messages, tools=tools) for messages, tools in chats]
    texts.append(render_prompt_text(bootstrap, ARITHMETIC, prompt))
    tokenizer = train_tiny_tokenizer(texts * 4, 700, out)
    config = models.preset(
        "tiny",
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_layers=num_layers,
        head_dim=hidden_size // 4,
        eos_token_ids=(tokenizer.eos_token_id,),
    )
    rows = []
    for messages, tools in chats:
        ids = encode_text(tokenizer, render_chat(tokenizer, messages, tools=tools))
        first_reply = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
        head = render_chat(tokenizer, messages[:first_reply], tools=tools, add_generation_prompt=True)
        start = len(encode_text(tokenizer, head + OPENER))
        rows.append((ids, start))
    width = max(len(ids) for ids, _ in rows)
    tokens = np.zeros((len(rows), width), np.int32)
    weights = np.zeros((len(rows), width), np.float32)
    for row, (ids, start) in enumerate(rows):
        tokens[row, : len(ids)] = ids
        weights[row, start : len(ids)] = 1.0  # every token after the first opener, tool output included

    def loss(params):
        logits, _ = models.forward(params, config, tokens[:, :-1])
        logp = models.token_logprobs(logits, tokens[:, 1:])
        return -jnp.sum(logp * weights[:, 1:]) / jnp.sum(weights[:, 1:])

    optimizer = optax.adam(1e-2)

    @jax.jit
    def step(params, opt_state):
        grads = jax.grad(loss)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params = models.init_params(config, jax.random.key(seed))
    opt_state = optimizer.init(params)
    for _ in range(steps):
        params, opt_state = step(params, opt_state)
    models.save_pretrained(params, config, out, tokenizer=tokenizer, prompt=prompt)
    return out
