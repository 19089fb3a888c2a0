"""A scripted tool-using tiny policy, for tests and benchmarks of the agentic rollout (no pretrained model).

``tiny_policy`` trains a byte-level BPE tokenizer on the rendered prompts and the scripted turns and draws
random weights of the ``tiny`` Qwen3 preset; ``teach_tool_use`` fits them (Adam, a few hundred steps) to one
two-turn conversation: call the Python tool with ``TOOL_CODE``, read its output, answer it. Sampled, the
policy then writes real tool calls, so rollouts exercise the sandbox and multi-turn decoding. Its answer is
the snippet's output, not the problem's: this drives the machinery, it does not solve problems.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax

from rstar2jax import models
from rstar2jax.agent import (
    PYTHON_TOOL_NAME,
    PromptConfig,
    SandboxResult,
    format_tool_result,
    render_prompt_ids,
    render_prompt_text,
    tool_response_ids,
)
from rstar2jax.data.chat_template import encode_text
from rstar2jax.data.problems import Problem
from rstar2jax.data.tokenizer import train_tiny_tokenizer

#: The call the tool-using policy learns to write: real work in the sandbox, a fixed output.
TOOL_CODE = "total = 0\nfor i in range(300000):\n    total += i * i % 7\nprint(total)"


def tool_code_output() -> str:
    """What ``TOOL_CODE`` prints (run here, in process: it is our own fixed snippet)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(TOOL_CODE, {})  # noqa: S102
    return out.getvalue()


def call_turn(code: str = TOOL_CODE) -> str:
    """A model turn that calls the Python tool with ``code`` (text after the ``<reason>`` opener)."""
    body = json.dumps({"name": PYTHON_TOOL_NAME, "arguments": {"code": code, "input": ""}})
    return f" Let me run it.</reason>\n<tool_call>\n{body}\n</tool_call>"


def answer_turn(answer: str) -> str:
    """A final model turn that answers ``answer``."""
    return f" It printed {answer}.</reason>\n<answer>\\boxed{{{answer}}}</answer><|im_end|>"


@dataclasses.dataclass
class TinyPolicy:
    """A tiny Qwen3-shaped model, its tokenizer and random weights."""

    tokenizer: object
    model_config: models.ModelConfig
    params: dict


def tiny_policy(
    problems: list[Problem],
    tokenizer_dir: str,
    *,
    vocab_size: int = 1024,
    seed: int = 0,
    prompt: PromptConfig | None = None,
) -> TinyPolicy:
    """A byte-level BPE tokenizer trained on the rendered prompts and the scripted turns, and random weights
    of the ``tiny`` Qwen3 preset over its vocabulary (EOS: ``<|im_end|>`` and ``<|endoftext|>``)."""
    bootstrap = train_tiny_tokenizer(["x"], 300, tokenizer_dir)  # renders the chat template for the corpus
    output = tool_code_output().strip()
    corpus = [render_prompt_text(bootstrap, p.problem, prompt) for p in problems]
    corpus += [call_turn(), answer_turn(output), format_tool_result(ok_result(output + "\n"), 2048)] * 4
    tokenizer = train_tiny_tokenizer(corpus, vocab_size, tokenizer_dir)
    config = models.preset(
        "tiny", vocab_size=len(tokenizer), eos_token_ids=(tokenizer.eos_token_id, tokenizer.pad_token_id)
    )
    return TinyPolicy(tokenizer, config, models.init_params(config, jax.random.key(seed)))


def ok_result(stdout: str) -> SandboxResult:
    """A successful sandbox result that printed ``stdout``."""
    return SandboxResult("ok", stdout, "", 0, None, 0.0)


def teach_tool_use(
    policy: TinyPolicy,
    problems: list[Problem],
    *,
    steps: int = 300,
    learning_rate: float = 3e-3,
    batch_size: int = 4,
    prompt: PromptConfig | None = None,
) -> dict:
    """Weights that write :func:`call_turn`, then (after the tool response) :func:`answer_turn` of the
    code's output, after any of these prompts: Adam on the masked next-token loss of those two turns, in
    minibatches of ``batch_size`` prompts taken in turn."""
    tokenizer, config = policy.tokenizer, policy.model_config
    output = tool_code_output()
    response = [
        (encode_text(tokenizer, call_turn()), 1),
        (tool_response_ids(tokenizer, format_tool_result(ok_result(output), 2048), prompt), 0),
        (encode_text(tokenizer, answer_turn(output.strip())), 1),
    ]
    rows = []
    for problem in problems:
        ids = render_prompt_ids(tokenizer, problem.problem, prompt)
        mask = [0] * len(ids)
        for piece, trained in response:
            ids, mask = ids + piece, mask + [trained] * len(piece)
        rows.append((ids, mask))
    width = max(len(ids) for ids, _ in rows)
    tokens = np.zeros((len(rows), width), np.int32)
    weights = np.zeros((len(rows), width), np.float32)
    for row, (ids, mask) in enumerate(rows):
        tokens[row, : len(ids)], weights[row, : len(mask)] = ids, mask

    def loss(params, tokens, weights):
        logits, _ = models.forward(params, config, tokens[:, :-1])
        logp = models.token_logprobs(logits, tokens[:, 1:])
        return -jnp.sum(logp * weights[:, 1:]) / jnp.sum(weights[:, 1:])

    optimizer = optax.adam(learning_rate)

    @jax.jit
    def step(params, opt_state, tokens, weights):
        grads = jax.grad(loss)(params, tokens, weights)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params, opt_state = policy.params, optimizer.init(policy.params)
    order = np.resize(np.arange(len(rows)), (steps, min(batch_size, len(rows))))  # prompts in turn, cycling
    for batch in order:
        params, opt_state = step(params, opt_state, tokens[batch], weights[batch])
    return params
