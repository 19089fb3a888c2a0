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
import json
import platform
import tempfile
import time

import jax
import numpy as np
from absl import app, flags

from rstar2jax.agent import (
    RolloutConfig,
    SandboxClient,
    SyncSandboxClient,
    render_prompt_ids,
    rollout_async,
)
from rstar2jax.agent.testing import TinyPolicy, teach_tool_use, tiny_policy
from rstar2jax.data.synthetic import make_task
from rstar2jax.engine import Engine, EngineConfig, SamplingParams, page_rounded
from rstar2jax.reward import AnswerVerifier
from sandbox_server import start_local


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
    max_len = page_rounded(longest_prompt + FLAGS.max_response_length)
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
