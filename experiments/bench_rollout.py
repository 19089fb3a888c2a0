"""Benchmark of the agentic rollout: trajectories/s with a tiny model and a real sandbox; where the time goes;
and the same workload on another version of the library.

  python -m experiments.bench_rollout [--problems=32 --samples=8 --max_response_length=192 --slots=64]
  python -m experiments.bench_rollout --baseline_dir=DIR   # DIR: a checkout (`git worktree add DIR e4ba0e0`)

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

Reported per run: wall time, this process's CPU seconds (engine, event loop, XLA threads; the sandbox and the
verifier run in processes of their own), trajectories/s, tool calls, and the share of session time spent
waiting on tool results vs on the engine (decoding, including waiting for a decode slot): per-trajectory
``timings`` summed over trajectories, ``tool / (tool + generate)``. Compilation is excluded (each policy's
workload runs once untimed first). Timings on a shared machine are noisy.

``--baseline_dir=DIR``: ``rollout_speedup``, the tool-using policy's async trajectories/s on this checkout's
library over the same on the library in DIR (the code before issue 31: goal >= 1.5). Both run in fresh
processes (``PYTHONPATH`` this checkout or DIR; the workload code, this script, is the same), taking turns
``--repeats`` times, best of each; the taught policy is written once to a folder both load.

The last line is one JSON object.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np
from absl import flags

from experiments import bench_record
from rstar2jax.agent import RolloutConfig, SandboxClient, SyncSandboxClient, render_prompt_ids, rollout_async
from rstar2jax.data.synthetic import make_task
from rstar2jax.engine import Engine, EngineConfig, SamplingParams
from rstar2jax.reward import AnswerVerifier
from sandbox_server import start_local

# KV page size (EngineConfig's default in every version): max_len is a whole number of pages. Rounded here,
# not with engine.page_rounded, because the workload also runs on a baseline library that predates it.
PAGE = 16


class BlockingSandbox:
    """The baseline's tool: a blocking client called on the event loop (no other coroutine runs meanwhile)."""

    def __init__(self, url: str):
        self.client = SyncSandboxClient(url)

    async def run(self, code: str, stdin: str = "", timeout: float | None = None):
        return self.client.run(code, stdin=stdin, timeout=timeout)

    def close(self):
        self.client.close()


async def timed_rollout(params, model_config, tokenizer, problems, samples, sandbox, verifier, engine_config,
                        config: RolloutConfig) -> tuple[float, float, list]:
    """(wall seconds, this process's CPU seconds, trajectories) of one rollout call."""
    async with Engine(params, model_config, engine_config) as engine:
        start, cpu = time.perf_counter(), time.process_time()
        trajectories = await rollout_async(problems, samples, engine=engine, sandbox=sandbox,
                                           tokenizer=tokenizer, verifier=verifier, config=config)
        return time.perf_counter() - start, time.process_time() - cpu, trajectories


def summarize(name: str, seconds: float, cpu_seconds: float, trajectories) -> dict:
    phase = lambda key: sum(t.timings.get(key, 0.0) for t in trajectories)  # noqa: E731
    tool, generate = phase("tool"), phase("generate")
    calls = sum(t.num_tool_calls for t in trajectories)
    return dict(
        run=name,
        wall_s=round(seconds, 3),
        cpu_s=round(cpu_seconds, 3),
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
    flags.DEFINE_string("baseline_dir", None, "A checkout of the library to compare with (rollout_speedup).")
    flags.DEFINE_integer("repeats", 3, "With --baseline_dir: fresh processes per side, taking turns.")
    flags.DEFINE_list("worker", None, "internal: POLICY_DIR,MODES of one measuring process")


def _policies(problems, tokenizer_dir):
    """(tiny policy, its taught params, seconds teaching took)."""
    from rstar2jax.agent.testing import teach_tool_use, tiny_policy

    policy = tiny_policy(problems, tokenizer_dir, seed=flags.FLAGS.seed)
    start = time.perf_counter()
    taught = teach_tool_use(policy, problems, steps=flags.FLAGS.teach_steps, learning_rate=1e-2)
    return policy, taught, time.perf_counter() - start


def measure(params_by_name: dict, model_config, tokenizer, problems, modes) -> list[dict]:
    """The timed runs (each after an untimed one of its policy: compiling) on this process's library."""
    FLAGS = flags.FLAGS
    longest_prompt = max(len(render_prompt_ids(tokenizer, p.problem)) for p in problems)
    max_len = -(-(longest_prompt + FLAGS.max_response_length) // PAGE) * PAGE
    engine_config = EngineConfig(num_slots=FLAGS.slots, max_len=max_len)
    config = RolloutConfig(max_response_length=FLAGS.max_response_length, seed=FLAGS.seed,
                           sampling=SamplingParams(temperature=1.0))
    rows = []
    with start_local(workers=FLAGS.sandbox_workers) as server, AnswerVerifier(num_workers=1) as verifier:
        blocking = BlockingSandbox(server.url)

        async def run():
            async with SandboxClient(server.url) as client:
                for name, params in params_by_name.items():
                    args = (params, model_config, tokenizer, problems, FLAGS.samples)
                    await timed_rollout(*args, client, verifier, engine_config, config)
                    for mode in modes:
                        sandbox = client if mode == "async" else blocking
                        timed = await timed_rollout(*args, sandbox, verifier, engine_config, config)
                        rows.append(summarize(f"{name}/{mode}", *timed))

        try:
            asyncio.run(run())
        finally:
            blocking.close()
    return rows


def worker(policy_dir: str, modes: str) -> None:
    """One measuring process (the library is whatever ``PYTHONPATH`` gives): the taught policy's runs."""
    import rstar2jax
    from rstar2jax.data.tokenizer import load_tokenizer
    from rstar2jax.models import load_pretrained

    task = make_task(flags.FLAGS.problems, 0, seed=flags.FLAGS.seed)
    model_config, params = load_pretrained(policy_dir)
    rows = measure({"tool-using": params}, model_config, load_tokenizer(policy_dir),
                   [p.as_problem() for p in task.train], modes.split("+"))
    print(json.dumps({"library": str(pathlib.Path(rstar2jax.__file__).parents[1]), "rows": rows}))


def compare(taught, policy, baseline_dir: str) -> dict:
    """``rollout_speedup``: this checkout's library over ``baseline_dir``'s on the taught policy (module
    docstring)."""
    from rstar2jax import models

    here = pathlib.Path(__file__).resolve().parents[1]
    runs = {"here": [], "baseline": []}
    with tempfile.TemporaryDirectory() as policy_dir:
        models.save_pretrained(taught, policy.model_config, policy_dir, tokenizer=policy.tokenizer)
        for _ in range(flags.FLAGS.repeats):
            for side, root in (("here", here), ("baseline", pathlib.Path(baseline_dir).resolve())):
                env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(here)])}
                argv = [f"--{name}={flags.FLAGS[name].value}" for name in
                        ("problems", "samples", "max_response_length", "slots", "sandbox_workers", "seed")]
                done = subprocess.run(
                    [sys.executable, str(here / "experiments" / "bench_rollout.py"), *argv,
                     f"--worker={policy_dir},async"], env=env, cwd=root, check=True, capture_output=True,
                    text=True)
                result = json.loads(done.stdout.strip().splitlines()[-1])
                if pathlib.Path(result["library"]).resolve() != root:
                    raise RuntimeError(f"the {side} worker imported the library from {result['library']}")
                row = result["rows"][0]
                runs[side].append(row)
                print(f"{side} ({root}): {row['traj_per_s']:.2f} trajectories/s, {row['cpu_s']:.2f} CPU s, "
                      f"tool share {row['tool_share']:.2f}", flush=True)
    best = {side: max(r["traj_per_s"] for r in rows) for side, rows in runs.items()}
    cpu = {side: min(r["cpu_s"] for r in rows) for side, rows in runs.items()}
    return {"rollout_traj_per_s": best["here"], "baseline_traj_per_s": best["baseline"],
            "rollout_speedup": round(best["here"] / best["baseline"], 3), "rollout_cpu_s": cpu["here"],
            "baseline_cpu_s": cpu["baseline"]}


def main(argv):
    del argv
    FLAGS = flags.FLAGS
    if FLAGS.worker:
        worker(*FLAGS.worker)
        return
    task = make_task(FLAGS.problems, 0, seed=FLAGS.seed)
    problems = [p.as_problem() for p in task.train]
    with tempfile.TemporaryDirectory() as tokenizer_dir:
        policy, taught, teach_seconds = _policies(problems, tokenizer_dir)
    if FLAGS.baseline_dir:
        figures = compare(taught, policy, FLAGS.baseline_dir)
        print(f"tool-using policy, async: {figures['rollout_traj_per_s']:.2f} trajectories/s here vs "
              f"{figures['baseline_traj_per_s']:.2f} with {FLAGS.baseline_dir}: rollout_speedup "
              f"{figures['rollout_speedup']:.2f}x (best of {FLAGS.repeats} each; load average "
              f"{os.getloadavg()[0]:.1f})")
        print(json.dumps(figures))
        return
    rows = measure({"random": policy.params, "tool-using": taught}, policy.model_config, policy.tokenizer,
                   problems, ("async", "blocking"))
    device = f"{jax.devices()[0]} ({platform.processor() or 'cpu'})"
    print(
        f"Agentic rollout on {device}: {len(problems)} problems x {FLAGS.samples} samples, budget "
        f"{FLAGS.max_response_length} tokens, {FLAGS.slots} slots, tiny Qwen3 (vocab "
        f"{policy.model_config.vocab_size}); teaching the tool call took {teach_seconds:.1f} s"
    )
    header = (
        f"{'run':<22}{'wall s':>8}{'cpu s':>8}{'traj/s':>9}{'calls':>7}{'parse err':>10}{'tokens':>9}"
        f"{'tool share':>12}{'decode share':>14}{'reward':>8}{'trunc':>7}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['run']:<22}{r['wall_s']:>8.2f}{r['cpu_s']:>8.2f}{r['traj_per_s']:>9.1f}{r['tool_calls']:>7}"
            f"{r['parse_errors']:>10}{r['response_tokens']:>9}{r['tool_share']:>12.1%}{r['decode_share']:>14.1%}{r['reward']:>8.2f}"
            f"{r['truncated']:>7.2f}"
        )
    by_run = {r["run"]: r for r in rows}
    speedup = by_run["tool-using/async"]["traj_per_s"] / by_run["tool-using/blocking"]["traj_per_s"]
    print(f"async tool calls vs blocking ones (tool-using policy): {speedup:.2f}x trajectories/s")
    print("(shared 2-core machine, other jobs running: timings are noisy)")
    figures = {
        "rollouts": len(problems) * FLAGS.samples,
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
    bench_record.run(main)
