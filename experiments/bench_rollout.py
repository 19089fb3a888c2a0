"""Benchmark of the agentic rollout: trajectories/s with a tiny model and a real sandbox; where the time goes.

  python -m experiments.bench_rollout [--problems=32 --samples=8 --max_response_length=192 --slots=64]

Workload: ``problems x samples`` rollouts (256 by default) of the synthetic integer task, prompts rendered
with the paper's system prompt and tool schema, a tiny Qwen3-shaped model (random weights, byte-level BPE
tokenizer trained here) decoding on this CPU, a real ``sandbox_server`` on loopback.

A random model almost never writes a tool call, so two policies are measured:
  random      the random weights: decoding only (sessions run to EOS or the budget; its few "calls" are
              stray ``</tool_call>`` tokens, answered with parse errors);
  tool-using  the same model after 200 Adam steps (4 of the benchmark's prompts each) on one scripted
              two-turn conversation: call the Python tool with ``TOOL_CODE``, read its output, answer.
              Sampled at temperature 1 it writes that call in most rollouts (sometimes garbled: parse
              errors), so those rollouts run real code in the sandbox (tens of ms of work per call) and
              decode a second turn after the appended tool response. Its answer is the snippet's output, not
              the problem's, so rewards stay 0: this measures throughput, not skill.
Each policy runs twice on the same seeds: ``async`` is :func:`rstar2jax.agent.rollout_async`; the baseline
``blocking`` is the same loop with each tool call made by a blocking client on the event loop (a rollout
written without async tool calls), which stalls decoding and every other session while a call runs.

Reported per run: wall time, trajectories/s, tool calls, and the share of session time spent waiting on tool
results vs on the engine (decoding, including waiting for a decode slot): per-trajectory ``timings`` summed
over trajectories, ``tool / (tool + generate)``. Compilation is excluded (each policy's workload runs once
untimed first). Timings on a shared machine are noisy. The last line is one JSON object.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import json
import platform
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags

from rstar2jax import models
from rstar2jax.agent import (
    PYTHON_TOOL_NAME,
    PromptConfig,
    RolloutConfig,
    SandboxClient,
    SandboxResult,
    SyncSandboxClient,
    format_tool_result,
    render_prompt_ids,
    render_prompt_text,
    rollout_async,
    tool_response_ids,
)
from rstar2jax.data.conversation import encode_text
from rstar2jax.data.problems import Problem
from rstar2jax.data.synthetic import make_task
from rstar2jax.data.tokenizer import train_tiny_tokenizer
from rstar2jax.engine import Engine, EngineConfig, SamplingParams
from rstar2jax.reward import AnswerVerifier
from sandbox_server import start_local

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
    """A byte-level BPE tokenizer trained on the rendered prompts and the scripted turns, and a random
    2-layer Qwen3-shaped model over its vocabulary (EOS: ``<|im_end|>`` and ``<|endoftext|>``)."""
    bootstrap = train_tiny_tokenizer(["x"], 300, tokenizer_dir)  # renders the chat template for the corpus
    output = tool_code_output().strip()
    corpus = [render_prompt_text(bootstrap, p.problem, prompt) for p in problems]
    corpus += [call_turn(), answer_turn(output), format_tool_result(ok_result(output + "\n"), 2048)] * 4
    tokenizer = train_tiny_tokenizer(corpus, vocab_size, tokenizer_dir)
    config = models.ModelConfig(
        model_type="qwen3",
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
        eos_token_ids=(tokenizer.eos_token_id, tokenizer.pad_token_id),
    )
    return TinyPolicy(tokenizer, config, models.init_params(config, jax.random.key(seed)))


def ok_result(stdout: str) -> SandboxResult:
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


class BlockingSandbox:
    """The baseline's tool: a blocking client called on the event loop (no other coroutine runs meanwhile)."""

    def __init__(self, url: str):
        self.client = SyncSandboxClient(url)

    async def run(self, code: str, stdin: str = "", timeout: float | None = None):
        return self.client.run(code, stdin=stdin, timeout=timeout)

    def close(self):
        self.client.close()


async def timed_rollout(
    params, policy: TinyPolicy, problems, samples, sandbox, verifier, engine_config, config: RolloutConfig
) -> tuple[float, list]:
    async with Engine(params, policy.model_config, engine_config) as engine:
        start = time.perf_counter()
        trajectories = await rollout_async(
            problems,
            samples,
            engine=engine,
            sandbox=sandbox,
            tokenizer=policy.tokenizer,
            verifier=verifier,
            config=config,
        )
        return time.perf_counter() - start, trajectories


def summarize(name: str, seconds: float, trajectories) -> dict:
    phase = lambda key: sum(t.timings.get(key, 0.0) for t in trajectories)  # noqa: E731
    tool, generate = phase("tool"), phase("generate")
    calls = sum(t.num_tool_calls for t in trajectories)
    return dict(
        run=name,
        wall_s=round(seconds, 3),
        trajectories=len(trajectories),
        traj_per_s=round(len(trajectories) / seconds, 2),
        tool_calls=calls,
        parse_errors=sum(o == "parse_error" for t in trajectories for o in t.tool_outcomes),
        response_tokens=sum(len(t.response_ids) for t in trajectories),
        tool_share=round(tool / max(tool + generate, 1e-9), 4),
        decode_share=round(generate / max(tool + generate, 1e-9), 4),
        reward=round(float(np.mean([t.reward for t in trajectories])), 4),
        truncated=round(float(np.mean([t.truncated for t in trajectories])), 4),
    )


def define_flags() -> None:
    """The benchmark's flags (defined only when it runs, so that tests can import its helpers)."""
    flags.DEFINE_integer("problems", 32, "Problems (engine groups).")
    flags.DEFINE_integer("samples", 8, "Rollouts per problem.")
    flags.DEFINE_integer("max_response_length", 192, "Response budget (tokens, tool tokens too).")
    flags.DEFINE_integer("slots", 64, "Engine slots (sequences decoded side by side).")
    flags.DEFINE_integer("teach_steps", 200, "Adam steps teaching the tool call (4 prompts each).")
    flags.DEFINE_integer("sandbox_workers", 2, "Sandbox server worker sets.")
    flags.DEFINE_integer("seed", 0, "Seed.")


def main(argv):
    del argv
    FLAGS = flags.FLAGS
    task = make_task(FLAGS.problems, 0, seed=FLAGS.seed)
    problems = [p.as_problem() for p in task.train]
    samples = FLAGS.samples
    with tempfile.TemporaryDirectory() as tokenizer_dir:
        policy = tiny_policy(problems, tokenizer_dir, seed=FLAGS.seed)
    teach_start = time.perf_counter()
    taught = teach_tool_use(policy, problems, steps=FLAGS.teach_steps, learning_rate=1e-2)
    teach_seconds = time.perf_counter() - teach_start
    longest_prompt = max(len(render_prompt_ids(policy.tokenizer, p.problem)) for p in problems)
    max_len = -(-(longest_prompt + FLAGS.max_response_length) // 16) * 16  # whole KV pages of 16 tokens
    engine_config = EngineConfig(num_slots=FLAGS.slots, max_len=max_len)
    config = RolloutConfig(max_response_length=FLAGS.max_response_length, seed=FLAGS.seed,
                           sampling=SamplingParams(temperature=1.0))
    rows = []
    with start_local(workers=FLAGS.sandbox_workers) as server, AnswerVerifier(num_workers=1) as verifier:
        blocking = BlockingSandbox(server.url)

        async def measure():
            async with SandboxClient(server.url) as client:
                for name, params in (("random", policy.params), ("tool-using", taught)):
                    # Warm-up on the same workload: compiles every program shape the measured runs will use.
                    await timed_rollout(
                        params, policy, problems, samples, client, verifier, engine_config, config
                    )
                    for mode, sandbox in (("async", client), ("blocking", blocking)):
                        seconds, trajectories = await timed_rollout(
                            params, policy, problems, samples, sandbox, verifier, engine_config, config
                        )
                        rows.append(summarize(f"{name}/{mode}", seconds, trajectories))

        try:
            asyncio.run(measure())
        finally:
            blocking.close()

    device = f"{jax.devices()[0]} ({platform.processor() or 'cpu'})"
    print(
        f"Agentic rollout on {device}: {len(problems)} problems x {samples} samples, budget "
        f"{FLAGS.max_response_length} tokens, {FLAGS.slots} slots, tiny Qwen3 (vocab "
        f"{policy.model_config.vocab_size}); teaching the tool call took {teach_seconds:.1f} s"
    )
    header = (
        f"{'run':<22}{'wall s':>8}{'traj/s':>9}{'calls':>7}{'parse err':>10}{'tokens':>9}"
        f"{'tool share':>12}{'decode share':>14}{'reward':>8}{'trunc':>7}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['run']:<22}{r['wall_s']:>8.2f}{r['traj_per_s']:>9.1f}{r['tool_calls']:>7}{r['parse_errors']:>10}"
            f"{r['response_tokens']:>9}{r['tool_share']:>12.1%}{r['decode_share']:>14.1%}{r['reward']:>8.2f}"
            f"{r['truncated']:>7.2f}"
        )
    by_run = {r["run"]: r for r in rows}
    speedup = by_run["tool-using/async"]["traj_per_s"] / by_run["tool-using/blocking"]["traj_per_s"]
    print(f"async tool calls vs blocking ones (tool-using policy): {speedup:.2f}x trajectories/s")
    print("(shared 2-core machine, other jobs running: timings are noisy)")
    figures = {
        "rollouts": len(problems) * samples,
        "traj_per_s": by_run["tool-using/async"]["traj_per_s"],
        "tool_share": by_run["tool-using/async"]["tool_share"],
        "decode_share": by_run["tool-using/async"]["decode_share"],
        "tool_calls": by_run["tool-using/async"]["tool_calls"],
        "random_traj_per_s": by_run["random/async"]["traj_per_s"],
        "blocking_traj_per_s": by_run["tool-using/blocking"]["traj_per_s"],
        "async_vs_blocking_speedup": round(speedup, 3),
        "teach_s": round(teach_seconds, 2),
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    define_flags()
    app.run(main)
