"""Benchmark of issue 40 (asynchronous RL). Parts, each adding rows to one table and keys to the last line's
JSON object (the keys are a contract):

* ``trl``: ``trl_grpo_step_ratio``, the wall time of one synchronous GRPO step of TRL's ``GRPOTrainer`` over
  ours on the same workload: the same tiny random-init Qwen3 (the demo model's shape: 2 layers, width 128,
  4 query / 2 KV heads of 32, a BPE vocabulary trained on the demo's task; both sides load the same HF
  folder, written by ``models.save_pretrained``), the same prompts (the demo's synthetic problems as plain
  text, no chat template, ``--prompts`` per step in the same order), ``--group`` samples per prompt, at most
  ``--completion_tokens`` new tokens at temperature 1, and the same plain answer reward (1 when the last
  integer of the completion is the gold answer; no tools: TRL's trainer is what a user would pick instead).
  TRL samples with its own generation (transformers ``generate``, no vLLM); both update with AdamW at lr
  1e-6, clip 0.2 / 0.28, no KL, token-mean loss, one update per generation batch, float32, on the CPU. Each
  side runs ``--steps`` + 1 steps in its own process; the first (compilation, warm-up) is not timed, the
  figure is the median of the rest, leaving out any later step of ours that compiled something (counted in
  the table). Ours is one ``rl_iteration`` per step with a rollout function on ``engine.generate`` (see
  :func:`ours_grpo_step_times`, the one place that calls the training API). Also reported: the ratio of
  CPU seconds per step (``trl_grpo_step_cpu_ratio``), less sensitive to other jobs on a shared machine.
  The workload sets the ratio: TRL's generation costs about the same per decode step whatever the batch
  (8 or 64 sequences), ours grows with the batch, so ``--prompts=1`` (8 sequences of 64 tokens) gives a
  larger ratio than ``--prompts=8`` (8 x 8); the default is the issue's 8 x 64 (1 prompt x 8 samples).
* ``async``: the synchronous schedule against the asynchronous one at eta=1 on the same workload
  (``experiments/_async_bench.py``: the tool-using tiny policy on the demo's problems, a real sandbox behind
  ``sandbox_server.latency_proxy``, median 0.5 s / p95 2 s per tool call), the same ``--updates`` from the
  same state and seeds, compile excluded (2 untimed updates first). ``async_speedup``: synchronous wall time
  per update over asynchronous, colocated (the engine on the trainer's device). ``async_speedup_ceiling``:
  synchronous wall time per update over its busy time per update (the engines' device-step seconds plus the
  update, measured in the synchronous run): what no waiting at all would give. ``async_speedup_split``: the
  same with the engine on a second emulated CPU device (its ceiling: the larger of engine and update time
  per update, what separate devices allow; here both share the same two cores). ``max_staleness_seen``
  (<= eta), ``trajectories_lost`` (released groups neither trained, counted dropped nor still waiting:
  0), ``reward_gap_async`` (mean reward of the last 10 updates, synchronous minus asynchronous).
* ``weights``: ``weight_update_ms_qwen3_0p6b``, an update of the Qwen3-0.6B shape (bfloat16) in flight,
  split placement: copied from the trainer's device into the engine's while it decodes, and queued.

TRL is a bench-only dependency (it is not needed by anything else): ``pip install trl==1.16.0`` (setup.py's
``bench`` extra), or beside this project without touching its environment,
``pip install --no-deps --target DIR trl==1.16.0`` (its dependencies are this project's) and
``--trl_path=DIR``.

  python -m experiments.bench_async --trl_path=DIR                # every part
  python -m experiments.bench_async --parts=async,weights         # the asynchronous schedule's parts
  python -m experiments.bench_async --parts=trl --trl_path=DIR   # one part

Prints a table (what, value, goal) and, as the last line, one JSON object. The load average is printed with
the figures: on a shared machine they are noisy.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from absl import flags

from experiments import _launch, bench_record

# ------------------------------------------------------------------------------------------------- flags
_PARTS = flags.DEFINE_list("parts", ["async", "weights", "trl"],
                           "parts to run (see the module docstring): async, weights, trl")
_TRL_PATH = flags.DEFINE_string(
    "trl_path", None, "a folder holding trl (pip install --no-deps --target DIR trl==1.16.0); default: the "
    "trl of this environment"
)
_PROMPTS = flags.DEFINE_integer("prompts", 1, "trl: prompts per GRPO step")
_GROUP = flags.DEFINE_integer("group", 8, "trl: samples per prompt (GRPO's group)")
_COMPLETION_TOKENS = flags.DEFINE_integer("completion_tokens", 64, "trl: most new tokens per sample")
_STEPS = flags.DEFINE_integer("steps", 3, "trl: timed steps per side, after one untimed first step")
_SEED = flags.DEFINE_integer("seed", 0, "seed of the problems, the weights and the sampling")
_UPDATES = flags.DEFINE_integer("updates", 12, "async: timed updates per run (after 2 untimed ones)")
_WORKER = flags.DEFINE_list("worker", None, "internal: SIDE,FOLDER of one side's measurement (trl or ours)")

#: JAX's monitoring event of one XLA compilation (``jax._src.dispatch.BACKEND_COMPILE_EVENT``).
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULT_PREFIX = "RESULT "


def positive_flags(*holders) -> None:
    """Exits 2 with one ``error:`` line when an integer flag is not positive (``_launch.fail``)."""
    for holder in holders:
        if holder.value < 1:
            _launch.fail(f"--{holder.name} must be >= 1, got {holder.value}")


# ---------------------------------------------------------------------------------------- the table
class Table:
    """Rows of (what, value, goal) printed as one aligned table; ``figures`` collects the JSON keys."""

    def __init__(self):
        self.rows: list[tuple[str, str, str]] = []
        self.figures: dict[str, float | int | str] = {}

    def add(self, what: str, value, goal: str = "", key: str | None = None, digits: int = 3) -> None:
        """A row; with ``key``, the value also goes into the last line's JSON under that name."""
        shown = f"{value:.{digits}f}" if isinstance(value, float) else str(value)
        self.rows.append((what, shown, goal))
        if key is not None:
            self.figures[key] = round(value, digits) if isinstance(value, float) else value

    def print(self) -> None:
        widths = [max(len(row[i]) for row in [("what", "value", "goal"), *self.rows]) for i in range(3)]
        for row in [("what", "value", "goal"), tuple("-" * w for w in widths), *self.rows]:
            print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())


# ------------------------------------------------------------------------------------ the TRL workload
@dataclasses.dataclass(frozen=True)
class Workload:
    """One GRPO step: ``prompts`` problems x ``group`` samples of at most ``completion_tokens`` tokens;
    ``steps`` timed steps after an untimed first one."""

    prompts: int
    group: int
    completion_tokens: int
    steps: int
    seed: int

    @property
    def num_problems(self) -> int:
        return self.prompts * (self.steps + 1)


#: The demo's model (experiments/configs/demo.py: the tiny preset widened) and its tokenizer's size.
DEMO_MODEL = dict(hidden_size=128, intermediate_size=384, head_dim=32, max_position_embeddings=1024)
DEMO_VOCAB = 2048
DEMO_FAMILIES = ("modpow", "lcm")
LEARNING_RATE = 1e-6
CLIP_LOW, CLIP_HIGH = 0.2, 0.28
_LAST_INTEGER = re.compile(r"-?\d+")


def answer_reward(completion: str, answer: str) -> float:
    """The plain answer reward both sides use: 1.0 when the last integer in ``completion`` is ``answer``."""
    numbers = _LAST_INTEGER.findall(completion)
    return float(bool(numbers) and numbers[-1] == answer)


def prompt_text(problem: str) -> str:
    """The prompt both sides sample from: the problem as plain text, no chat template."""
    return f"{problem}\nAnswer:"


def write_policy_folder(folder: str, workload: Workload) -> None:
    """The shared workload in ``folder``: an HF policy folder (the demo-shaped random-init Qwen3 and a BPE
    tokenizer trained on the demo's task) and ``problems.jsonl`` (id, prompt, answer), in step order."""
    import jax

    from rstar2jax import models
    from rstar2jax.data.synthetic import make_task
    from rstar2jax.data.tokenizer import train_tiny_tokenizer

    corpus = make_task(2000, 0, seed=workload.seed + 1, families=DEMO_FAMILIES).train
    texts = [f"{prompt_text(p.problem)} {p.answer}\n{p.solution}" for p in corpus]
    tokenizer = train_tiny_tokenizer(texts, DEMO_VOCAB, os.path.join(folder, "tokenizer"), digit_group=3)
    eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    config = models.preset("tiny", **DEMO_MODEL, vocab_size=len(tokenizer), eos_token_ids=(eos,))
    params = models.init_params(config, jax.random.PRNGKey(workload.seed))
    models.save_pretrained(params, config, folder, tokenizer=tokenizer)
    problems = make_task(workload.num_problems, 0, seed=workload.seed, families=DEMO_FAMILIES).train
    with open(os.path.join(folder, "problems.jsonl"), "w", encoding="utf-8") as f:
        for p in problems:
            f.write(json.dumps({"id": p.id, "prompt": prompt_text(p.problem), "answer": p.answer}) + "\n")


def read_problems(folder: str) -> list[dict]:
    with open(os.path.join(folder, "problems.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


class StepClock:
    """Wall, CPU (this process, all threads) and XLA compilation seconds of each step, between ``begin`` and
    ``end``; compilations are seen once ``watch_jax_compiles`` was called."""

    def __init__(self):
        self.wall, self.cpu, self.compile = [], [], []
        self._compiles: list[float] = []
        self._start = (0.0, 0.0, 0)

    def watch_jax_compiles(self) -> None:
        import jax

        def on_duration(event, duration, **_):
            if event == BACKEND_COMPILE_EVENT:
                self._compiles.append(duration)

        jax.monitoring.register_event_duration_secs_listener(on_duration)

    def begin(self) -> None:
        self._start = (time.perf_counter(), time.process_time(), len(self._compiles))

    def end(self) -> None:
        wall, cpu, compiled = self._start
        self.wall.append(time.perf_counter() - wall)
        self.cpu.append(time.process_time() - cpu)
        self.compile.append(sum(self._compiles[compiled:]))

    def result(self) -> dict:
        return {"step_s": self.wall, "cpu_s": self.cpu, "compile_s": self.compile}


# ---------------------------------------------------------------------------------------- the TRL side
def trl_grpo_step_times(folder: str, workload: Workload) -> dict:
    """TRL's ``GRPOTrainer`` for ``steps`` + 1 steps on the workload; per-step wall times (first included)."""
    import datasets
    import torch
    import transformers
    import trl

    torch.manual_seed(workload.seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    dataset = datasets.Dataset.from_list(read_problems(folder))

    def reward(completions, answer, **_):
        return [answer_reward(c, a) for c, a in zip(completions, answer, strict=True)]

    clock, generate_s = StepClock(), []
    generate = model.generate

    def timed_generate(*args, **kwargs):  # TRL calls it once per step, on the whole generation batch
        start = time.perf_counter()
        try:
            return generate(*args, **kwargs)
        finally:
            generate_s.append(time.perf_counter() - start)

    model.generate = timed_generate

    class StepTimer(transformers.TrainerCallback):
        def on_step_begin(self, *args, **kwargs):
            clock.begin()

        def on_step_end(self, *args, **kwargs):
            clock.end()

    with tempfile.TemporaryDirectory() as output:
        args = trl.GRPOConfig(
            output_dir=output, per_device_train_batch_size=workload.prompts * workload.group,
            num_generations=workload.group, max_completion_length=workload.completion_tokens,
            gradient_accumulation_steps=1, max_steps=workload.steps + 1, shuffle_dataset=False,
            learning_rate=LEARNING_RATE, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0,
            epsilon=CLIP_LOW, epsilon_high=CLIP_HIGH, beta=0.0, loss_type="dapo", temperature=1.0,
            gradient_checkpointing=False,  # TRL's default recomputes activations; ours does not
            use_cpu=True, bf16=False, report_to="none", save_strategy="no", logging_steps=1,
            disable_tqdm=True, seed=workload.seed,
        )
        trainer = trl.GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset,
                                  processing_class=tokenizer, callbacks=[StepTimer()])
        trainer.train()
    logs = [entry for entry in trainer.state.log_history if "completions/mean_length" in entry]
    return {
        **clock.result(),  # no JAX: compile_s stays 0
        "phases": [{"rollout_s": g, "update_s": s - g} for g, s in zip(generate_s, clock.wall, strict=True)],
        "tokens": [entry["completions/mean_length"] * workload.prompts * workload.group for entry in logs],
        "reward": [entry["reward"] for entry in logs],
        "version": trl.__version__,
        "threads": torch.get_num_threads(),
    }


# ---------------------------------------------------------------------------------------- our side
def ours_grpo_step_times(folder: str, workload: Workload) -> dict:
    """Our synchronous GRPO step for ``steps`` + 1 steps on the workload; per-step wall times (first
    included: it compiles).

    The library calls (the training API's one boundary in this benchmark): ``models.load_pretrained``,
    ``engine.generate`` / ``engine.EngineConfig`` (the rollout function), ``train.make_optimizer``,
    ``train.RLLossConfig``, ``train.make_rl_step``, ``train.RLIterationConfig``, ``train.init_train_state``,
    ``train.rl_iteration`` (its ``reward_fn`` scores with :func:`answer_reward`). Plain GRPO as TRL runs it:
    every sample of a group is trained on (``keep`` = group, ``roc_mode="uniform"``, groups of equal rewards
    kept with zero advantages), one trajectory per row.
    """
    import jax

    from rstar2jax import engine, models, train
    from rstar2jax.data.problems import Problem
    from rstar2jax.data.tokenizer import load_tokenizer
    from rstar2jax.data.trajectory import Trajectory

    config, params = models.load_pretrained(folder)
    tokenizer = load_tokenizer(folder)
    rows = read_problems(folder)
    prompt_ids = {row["id"]: tokenizer.encode(row["prompt"], add_special_tokens=False) for row in rows}
    problems = [Problem(id=row["id"], problem=row["prompt"], answer=row["answer"]) for row in rows]
    longest = max(len(ids) for ids in prompt_ids.values()) + workload.completion_tokens
    samples = workload.prompts * workload.group
    engine_config = engine.EngineConfig(num_slots=samples, max_len=engine.page_rounded(longest))

    def rollout(params, problems, *, samples_per_problem, max_response_length, max_turns, seed,
                policy_version):
        del max_turns  # one turn, no tools
        prompts = [prompt_ids[p.id] for p in problems for _ in range(samples_per_problem)]
        generations = engine.generate(
            params, config, prompts, max_new_tokens=max_response_length, temperature=1.0, seed=seed,
            engine_config=engine_config, policy_version=policy_version,
        )
        owners = [p for p in problems for _ in range(samples_per_problem)]
        return [
            Trajectory(problem_id=p.id, prompt_ids=prompt, response_ids=g.tokens,
                       loss_mask=[1] * len(g.tokens), logprobs=g.logprobs,
                       truncated=g.finish_reason == "budget", policy_versions=g.policy_versions)
            for p, prompt, g in zip(owners, prompts, generations, strict=True)
        ]

    def reward(problem, trajectory):
        text = tokenizer.decode(trajectory.response_ids, skip_special_tokens=True)
        return answer_reward(text, problem.answer)

    optimizer = train.make_optimizer(LEARNING_RATE, warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0)
    step = train.make_rl_step(config, optimizer, train.RLLossConfig(eps_low=CLIP_LOW, eps_high=CLIP_HIGH))
    iteration = train.RLIterationConfig(
        samples_per_problem=workload.group, keep=workload.group, roc_mode="uniform",
        reject_equal_reward=False, seq_len=longest, pack=False,
    )
    # Committed to the device, as the launchers' sharded state is: the update then compiles once, not again
    # at the second step for the committed arrays the first step returns.
    state = jax.device_put(train.init_train_state(params, optimizer, workload.seed), jax.devices()[0])
    clock, tokens, rewards, phases = StepClock(), [], [], []
    clock.watch_jax_compiles()  # the engine compiles a program per token bucket as it first meets it
    for k in range(workload.steps + 1):
        clock.begin()
        state, metrics = train.rl_iteration(
            state, problems[k * workload.prompts : (k + 1) * workload.prompts], rollout_fn=rollout,
            rl_step=step, config=iteration, max_response_length=workload.completion_tokens, max_turns=1,
            reward_fn=reward, num_rows=samples,
        )
        jax.block_until_ready(state.params)
        clock.end()
        tokens.append(metrics["response_length"] * samples)
        rewards.append(metrics["reward"])
        phases.append({"rollout_s": metrics["time/rollout"], "update_s": metrics["time/update"]})
    return {**clock.result(), "tokens": tokens, "reward": rewards, "phases": phases}


# ---------------------------------------------------------------------------------------- workers
def worker(side: str, folder: str, workload: Workload) -> None:
    """One side's measurement in this process; prints its result as the last line."""
    measure = {"trl": trl_grpo_step_times, "ours": ours_grpo_step_times}[side]
    result = measure(folder, workload)
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def run_worker(side: str, folder: str, extra_path: str | None = None) -> dict:
    """Runs ``worker`` in a fresh process (its own memory and threads); ``extra_path`` goes first on its
    PYTHONPATH."""
    args = [sys.executable, "-m", "experiments.bench_async", f"--worker={side},{folder}",
            f"--prompts={_PROMPTS.value}", f"--group={_GROUP.value}",
            f"--completion_tokens={_COMPLETION_TOKENS.value}", f"--steps={_STEPS.value}",
            f"--seed={_SEED.value}"]
    path = [p for p in (extra_path, REPO, os.environ.get("PYTHONPATH")) if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(args, capture_output=True, text=True, env=env, cwd=REPO)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if done.returncode or not lines:
        raise RuntimeError(f"the {side} side failed (exit code {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(lines[-1][len(RESULT_PREFIX) :])


def trl_location() -> str | None:
    """The folder to put first on the TRL worker's path (None: this environment's trl); exits 2 when there
    is no trl."""
    if _TRL_PATH.value is not None:
        if not os.path.isfile(os.path.join(_TRL_PATH.value, "trl", "__init__.py")):
            _launch.fail(f"--trl_path={_TRL_PATH.value!r} holds no trl package (trl/__init__.py)")
        return os.path.abspath(_TRL_PATH.value)
    if importlib.util.find_spec("trl") is None:
        _launch.fail(
            "trl is not installed: pip install --no-deps --target DIR trl==1.16.0 and pass --trl_path=DIR"
        )
    return None


# ------------------------------------------------------------------------------------------- parts
def timed_steps(result: dict, side: str) -> list[int]:
    """The steps a side's figure is the median of: after the first, and none that compiled anything."""
    kept = [k for k in range(1, len(result["step_s"])) if result["compile_s"][k] == 0]
    if not kept:
        _launch.fail(f"every timed step of the {side} side compiled something: raise --steps")
    return kept


def trl_part(table: Table) -> None:
    """``trl_grpo_step_ratio``: TRL's GRPO step over ours, median wall times of the steps after the first
    (leaving out any step that compiled: the engine compiles a program per token bucket when it first meets
    one, which can be in a later step).

    Also the same ratio of CPU seconds per step (less sensitive to other jobs on a shared machine) and each
    side's load average (1 min, mean of its start and end)."""
    trl_path = trl_location()
    workload = Workload(_PROMPTS.value, _GROUP.value, _COMPLETION_TOKENS.value, _STEPS.value, _SEED.value)
    results, loads = {}, {}
    with tempfile.TemporaryDirectory(prefix="bench_async_trl-") as folder:
        write_policy_folder(folder, workload)
        for side, extra_path in (("ours", None), ("trl", trl_path)):
            before = os.getloadavg()[0]
            results[side] = run_worker(side, folder, extra_path)
            loads[side] = (before + os.getloadavg()[0]) / 2
    ours, theirs = results["ours"], results["trl"]
    steps = {side: timed_steps(result, side) for side, result in results.items()}
    median = lambda side, values: statistics.median(values[k] for k in steps[side])
    ours_s, trl_s = median("ours", ours["step_s"]), median("trl", theirs["step_s"])
    per_step = f"{workload.prompts} x {workload.group} samples, <= {workload.completion_tokens} tokens"
    phases = lambda side: " / ".join(
        f"{median(side, [phase[name] for phase in results[side]['phases']]):.3f}"
        for name in ("rollout_s", "update_s")
    )
    table.add(f"TRL {theirs['version']} GRPOTrainer s/step ({per_step})", trl_s, key="trl_step_s")
    table.add("  TRL generate s / the rest s", phases("trl"))
    table.add("ours s/step (rl_iteration on engine.generate)", ours_s, key="ours_step_s")
    table.add("  ours rollout s / update s", phases("ours"))
    table.add("  ours first step s (compiles; not timed)", ours["step_s"][0], digits=1,
              key="ours_first_step_s")
    table.add("  ours later steps that compiled (not timed)", workload.steps - len(steps["ours"]))
    table.add("tokens per step, ours / TRL (mean of timed steps)",
              f"{statistics.mean(ours['tokens'][1:]):.0f} / {statistics.mean(theirs['tokens'][1:]):.0f}")
    table.figures["tokens_per_step"] = round(statistics.mean(ours["tokens"][1:]))
    table.figures["trl_tokens_per_step"] = round(statistics.mean(theirs["tokens"][1:]))
    table.add("mean reward, ours / TRL (same rule, random-init policy)",
              f"{statistics.mean(ours['reward']):.3f} / {statistics.mean(theirs['reward']):.3f}")
    ours_cpu, trl_cpu = median("ours", ours["cpu_s"]), median("trl", theirs["cpu_s"])
    table.add("CPU s/step, ours / TRL", f"{ours_cpu:.3f} / {trl_cpu:.3f}")
    table.add("peak RSS MiB, ours / TRL", f"{ours['peak_rss_mib']:.0f} / {theirs['peak_rss_mib']:.0f}")
    table.add("load average while measured, ours / TRL", f"{loads['ours']:.1f} / {loads['trl']:.1f}")
    table.add("torch threads (TRL side)", theirs["threads"])
    table.add("CPU s/step ratio (TRL over ours)", trl_cpu / ours_cpu, key="trl_grpo_step_cpu_ratio")
    table.add("trl_grpo_step_ratio (TRL s/step over ours)", trl_s / ours_s, ">= 10",
              key="trl_grpo_step_ratio")


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def async_part(table: Table) -> None:
    """``async_speedup``, its ceiling, the split figure, staleness, accounting and the reward gap (module
    doc)."""
    import jax

    from experiments import _async_bench as bench
    from rstar2jax.reward import AnswerVerifier
    from sandbox_server import start_local
    from sandbox_server.latency_proxy import start_latency_proxy

    workload = bench.AsyncWorkload(updates=_UPDATES.value, seed=_SEED.value)
    with tempfile.TemporaryDirectory(prefix="bench_async-") as folder:
        policy, problems, prompt = bench.taught_policy(workload, folder)
    max_prompt = bench.longest_prompt(policy, problems, prompt)
    pieces = bench.train_pieces(policy, workload, max_prompt)
    runs = {}
    with (start_local(workers=2) as server, start_latency_proxy(server.url, seed=_SEED.value) as proxy,
          AnswerVerifier(num_workers=1) as verifier):
        rollout_fn = bench.policy_rollout(policy, prompt, proxy.url, verifier, workload, max_prompt)
        run = lambda **how: bench.run_schedule(policy, problems, rollout_fn, pieces, workload, **how)
        try:
            runs["sync"] = run(asynchronous=False)
            engines = rollout_fn.engines[-workload.updates:]  # the timed updates' (one call each)
            runs["async"] = run(asynchronous=True)
            if len(jax.devices()) > 1:
                runs["split"] = run(asynchronous=True, rollout_device=jax.devices()[1])
        finally:
            rollout_fn.close()
    sync = runs["sync"]
    engine_s = sum(e.core.stats["busy_s"] for e in engines) / workload.updates
    update_s = _mean(m["time/update"] for m in sync["history"])
    per = f"{workload.prompts} x {workload.samples} rollouts, <= {workload.max_response_length} tokens"
    table.add(f"synchronous s/update ({per}, tool calls 0.5 s median)", sync["s_per_update"])
    table.add("  its engine busy s / update s (per update)", f"{engine_s:.3f} / {update_s:.3f}")
    for name in ("async", "split"):
        if name not in runs:
            continue
        run = runs[name]
        label = "asynchronous eta=1, " + ("colocated" if name == "async" else "split 1 + 1 devices")
        table.add(f"{label} s/update", run["s_per_update"])
        table.add("  rollout busy / trainer busy (mean fractions)",
                  f"{_mean(m['async/rollout_busy'] for m in run['history']):.2f} / "
                  f"{_mean(m['async/trainer_busy'] for m in run['history']):.2f}")
        table.add("  buffer depth (mean) / weight update ms (mean)",
                  f"{_mean(m['async/buffer_depth'] for m in run['history']):.2f} / "
                  f"{1000 * _mean(m['async/weight_update_s'] for m in run['history']):.1f}")
    ceiling = sync["s_per_update"] / (engine_s + update_s)
    speedup = sync["s_per_update"] / runs["async"]["s_per_update"]
    table.add("async_speedup_ceiling (sync s / busy s per update)", ceiling, key="async_speedup_ceiling")
    table.add("async_speedup (sync over async, colocated)", speedup, ">= 1.4 and >= 0.8 x ceiling",
              key="async_speedup")
    if "split" in runs:
        table.add("async_speedup_split (sync over async, split)", sync["s_per_update"] / runs["split"][
            "s_per_update"], "report", key="async_speedup_split")
        table.add("  split ceiling (sync s / max(engine, update) s)",
                  sync["s_per_update"] / max(engine_s, update_s), key="async_speedup_split_ceiling")
    asynchronous = [run for name, run in runs.items() if name != "sync"]
    seen = max(m.get("staleness/max", 0.0) for run in asynchronous for m in run["history"])
    lost = sum(run["ledger"]["released"] - run["ledger"]["trained"] - run["ledger"]["dropped"]
               - run["outstanding"] for run in asynchronous)
    table.add("max_staleness_seen (eta = 1)", int(seen), "<= 1", key="max_staleness_seen")
    table.add("trajectories_lost (groups released, not trained, dropped or waiting)", int(lost), "0",
              key="trajectories_lost")
    last = min(10, workload.updates)
    gap = _mean(sync["rewards"][-last:]) - _mean(runs["async"]["rewards"][-last:])
    table.add(f"mean reward of the last {last} updates, sync / async",
              f"{_mean(sync['rewards'][-last:]):.3f} / {_mean(runs['async']['rewards'][-last:]):.3f}")
    table.add("reward_gap_async (sync minus async)", gap, "<= 0.02", key="reward_gap_async")


def weights_part(table: Table) -> None:
    """``weight_update_ms_qwen3_0p6b`` (module doc)."""
    from experiments import _async_bench as bench

    result = bench.weight_update_ms()
    table.add(f"in-flight update, Qwen3-0.6B shape ({result['params'] / 1e6:.0f} M params, bf16), split: "
              "copy + queue ms", result["ms"], "report", key="weight_update_ms_qwen3_0p6b", digits=1)


#: The parts, in the order they run; each adds rows and JSON keys to the table.
PARTS = {"async": async_part, "weights": weights_part, "trl": trl_part}


def main(argv) -> None:
    del argv
    positive_flags(_PROMPTS, _GROUP, _COMPLETION_TOKENS, _STEPS, _UPDATES)
    if _WORKER.value:
        side, folder = _WORKER.value
        worker(side, folder, Workload(_PROMPTS.value, _GROUP.value, _COMPLETION_TOKENS.value, _STEPS.value,
                                      _SEED.value))
        return
    unknown = sorted(set(_PARTS.value) - set(PARTS))
    if unknown or not _PARTS.value:
        _launch.fail(f"--parts: unknown or none {unknown}; choose from {list(PARTS)}")
    if "trl" in _PARTS.value:
        trl_location()  # no trl: exit 2 before the other parts' minutes of work
    if {"async", "weights"} & set(_PARTS.value):
        from rstar2jax.train.runtime import request_host_devices

        request_host_devices(2)  # split placement: the engine on a second (emulated) CPU device
    table = Table()
    table.add("load average (1 min) at the start", os.getloadavg()[0], digits=2, key="load_average_start")
    for name, part in PARTS.items():
        if name in _PARTS.value:
            part(table)
    table.add("load average (1 min) at the end", os.getloadavg()[0], digits=2, key="load_average_end")
    table.print()
    print(json.dumps(table.figures), flush=True)


if __name__ == "__main__":
    bench_record.run(main)
