"""Test fixture: a scripted rollout (deterministic token streams instead of an engine and a sandbox) and a
small driver that trains the tiny CPU recipe with it, so a run can be killed and resumed in a subprocess.

  python -m tests.train.scripted --config.workdir=/tmp/run [--delay=0.2] [--max_steps=2] [--config.rl.keep=2]
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
import types
import zlib

import jax
import numpy as np

from rstar2jax import models
from rstar2jax.data.rollout_contract import declare_record_types
from rstar2jax.data.trajectory import Trajectory, trajectory_from_dict, trajectory_to_dict

TINY_VOCAB = 256


def set_fields(config, fields: dict):
    """``config`` with each ``{"section.field": value}`` of ``fields`` set (dotted paths); returns it."""
    for path, value in fields.items():
        *parents, leaf = path.split(".")
        node = config
        for part in parents:
            node = node[part]
        node[leaf] = value
    return config


def tiny_rl_config(workdir: str):
    """The tiny CPU recipe shrunk further: 256-token vocabulary, 3 + 3 steps, checkpoints every 2 steps."""
    from experiments.configs import tiny_cpu
    from rstar2jax.config.config import stage

    c = tiny_cpu.get_config()
    c.workdir = workdir
    c.tokenizer = ""
    c.model.spec.vocab_size = TINY_VOCAB
    c.model.spec.eos_token_ids = (1,)
    c.model.spec.hidden_size = 32
    c.model.spec.intermediate_size = 64
    c.model.scan_layers = False  # unrolled layers compile faster on CPU
    c.batch.max_prompt_length = 16
    c.rl.prompts_per_step = 3
    c.stages = [
        stage("stage1", steps=3, max_response_length=24, max_turns=3),
        stage(
            "stage2",
            steps=3,
            max_response_length=32,
            max_turns=4,
            hard_filter_rollouts=2,
            reset_optimizer=True,
        ),
    ]
    c.optimizer.warmup_steps = 2  # the stage-2 optimizer reset restarts it: visible in learning_rate
    c.batch.pack = False  # fixed rows: one compiled step per stage
    c.checkpoint.save_every = 2
    c.logging.progress = False
    return c


# Produced by main's code before policy versions, partial rollouts and off-policy steps existed (commit
# 68a3a72), in the session that added them: ``train_rl(tiny_rl_config(d), rollout_fn=make_scripted_rollout(),
# max_steps=2)`` on the CPU backend (the second step's numbers depend on the parameters the first step's
# update produced). The default run must keep them (``tests/train/test_colocate.py``).
MAIN_HISTORY = [
    {"loss": 0.03923498094081879, "grad_norm": 0.01573694869875908, "reward": 0.75, "selected": 4.0,
     "entropy": 5.537577152252197, "approx_kl": 3.999556064605713, "tokens": 62.0},
    {"loss": 0.40422937273979187, "grad_norm": 0.016745366156101227, "reward": 0.5, "selected": 4.0,
     "entropy": 5.537692546844482, "approx_kl": 3.980048179626465, "tokens": 43.0},
]


def _trajectory_logprobs(params, model_config, prompt, response) -> np.ndarray:
    tokens = np.array([prompt + response], np.int32)
    logits, _ = models.forward(params, model_config, tokens)
    logp = np.asarray(models.token_logprobs(logits[:, :-1], tokens[:, 1:]))[0]
    return logp[len(prompt) - 1 :]


def make_scripted_rollout(*, vocab_size: int = TINY_VOCAB, model_config=None, delay: float = 0.0):
    """A rollout_fn whose trajectories depend only on (seed, problem id, sample index).

    Per problem, the chance of a correct answer is fixed by its id (some are always solved, some never), so
    the hard-problem filter has something to drop. Responses interleave sampled tokens (mask 1) with inserted
    tool tokens (mask 0). Log-probs are random negatives, or with ``model_config`` the policy's own log-probs
    (so sampler and recomputed log-probs agree).
    """

    def rollout(params, problems, *, samples_per_problem, max_response_length, max_turns, seed,
                policy_version=None):
        del policy_version  # no versions recorded: the trainer tags the sampled tokens with it
        time.sleep(delay)
        trajectories = []
        for problem in problems:
            key = zlib.crc32(problem.id.encode())
            p_correct = [0.0, 0.5, 1.0, 0.3][key % 4]
            rng = np.random.default_rng([seed, key])
            prompt = rng.integers(2, vocab_size, int(rng.integers(4, 12))).tolist()
            for _ in range(samples_per_problem):
                length = int(rng.integers(4, max_response_length + 1))
                response = rng.integers(2, vocab_size, length).tolist()
                mask = np.ones(length, np.int32)
                num_turns = int(rng.integers(1, max_turns + 1))
                for _ in range(num_turns - 1):  # a tool response inside the response: inserted, not trained
                    start = int(rng.integers(1, length))
                    mask[start : start + int(rng.integers(1, 4))] = 0
                outcomes = rng.choice(
                    ["ok", "error", "timeout"], size=num_turns - 1, p=[0.6, 0.3, 0.1]
                ).tolist()
                if model_config is None:
                    logprobs = np.where(mask == 1, -rng.random(length) * 3, 0.0)
                else:
                    logprobs = np.where(
                        mask == 1, _trajectory_logprobs(params, model_config, prompt, response), 0.0
                    )
                trajectories.append(
                    Trajectory(
                        problem_id=problem.id,
                        prompt_ids=prompt,
                        response_ids=response,
                        loss_mask=mask.tolist(),
                        logprobs=logprobs.tolist(),
                        tool_outcomes=outcomes,
                        num_turns=num_turns,
                        num_answer_blocks=int(rng.integers(0, 3)),
                        truncated=length == max_response_length,
                        reward=float(rng.random() < p_correct),
                        timings={"generate": 0.01, "tool": 0.002},
                    )
                )
        return trajectories

    return rollout


@dataclasses.dataclass
class ScriptedPartial:
    """An unfinished scripted rollout: the part of ``target`` produced so far (``num_tokens`` response
    tokens, each sampled one tagged with the version of the call that produced it)."""

    problem_id: str
    target: Trajectory
    num_tokens: int = 0
    policy_versions: list[int] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict:
        return {"problem_id": self.problem_id, "target": trajectory_to_dict(self.target),
                "num_tokens": self.num_tokens, "policy_versions": list(self.policy_versions)}

    @classmethod
    def from_dict(cls, record: dict) -> ScriptedPartial:
        return cls(record["problem_id"], trajectory_from_dict(record["target"]), record["num_tokens"],
                   list(record["policy_versions"]))


declare_record_types({"ScriptedPartial": ScriptedPartial})


def make_partial_scripted_rollout(*, vocab_size: int = TINY_VOCAB):
    """A rollout_fn with the partial-rollout protocol, a ``partial(params, problems, ..., policy_version,
    token_budget, resume)`` method: each trajectory is ``make_scripted_rollout``'s, produced token by token,
    resumed rollouts first, until the call has produced ``token_budget`` tokens; returns ``(finished,
    unfinished)``."""
    scripted = make_scripted_rollout(vocab_size=vocab_size)

    def rollout(params, problems, *, samples_per_problem, max_response_length, max_turns, seed,
                policy_version, token_budget, resume):
        fresh = scripted(params, problems, samples_per_problem=samples_per_problem,
                         max_response_length=max_response_length, max_turns=max_turns, seed=seed)
        todo = list(resume) + [ScriptedPartial(t.problem_id, t) for t in fresh]
        finished, unfinished, left = [], [], token_budget
        for item in todo:
            take = min(len(item.target.response_ids) - item.num_tokens, left)
            mask = item.target.loss_mask[item.num_tokens : item.num_tokens + take]
            versions = item.policy_versions + [policy_version if m else -1 for m in mask]
            item = dataclasses.replace(item, num_tokens=item.num_tokens + take, policy_versions=versions)
            left -= take
            if item.num_tokens == len(item.target.response_ids):
                finished.append(dataclasses.replace(item.target, policy_versions=versions))
            else:
                unfinished.append(item)
        return finished, unfinished

    return types.SimpleNamespace(partial=rollout)


@dataclasses.dataclass
class _Job:
    key: tuple
    trajectories: list[Trajectory]
    start: float
    duration: float
    versions: list[list[int]] = dataclasses.field(default_factory=list)


class ScriptedStream:
    """The stream of ``rstar2jax.schedules.async_schedule`` over a scripted rollout's trajectories (those its
    synchronous call gives for the same seed and problem): each group takes a random time (uniform up to
    ``max_delay`` s, drawn from ``delay_seed``) on a thread of its own, its sampled tokens produced evenly
    over that time, each tagged with the version the stream held when it was produced. ``received``: the
    (version, weights) it was given, the first at opening."""

    def __init__(self, scripted, params, *, policy_version, samples_per_problem, max_response_length,
                 max_turns, on_update, device, max_delay: float, delay_seed: int):
        del on_update
        self.scripted, self.device, self.version = scripted, device, policy_version
        self.options = dict(samples_per_problem=samples_per_problem, max_response_length=max_response_length,
                            max_turns=max_turns)
        self.received = [(policy_version, params)]
        self.max_delay, self.rng = max_delay, np.random.default_rng(delay_seed)
        self.jobs: list[_Job] = []
        self.submitted: list = []  # every key submitted, in order
        self.done: queue.Queue = queue.Queue()
        self.lock, self.stop = threading.Lock(), threading.Event()
        self.counts = {"busy_s": 0.0, "generated_tokens": 0.0}
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def submit(self, key, problem, *, seed, index):
        del index  # scripted groups depend on (seed, problem id) only
        self.submitted.append(key)
        trajectories = self.scripted(self.received[-1][1], [problem], **self.options, seed=seed)
        with self.lock:
            self.jobs.append(_Job(key, trajectories, time.perf_counter(), self.rng.uniform(0, self.max_delay),
                                  [[] for _ in trajectories]))

    def _run(self):
        last = time.perf_counter()
        while not self.stop.wait(0.002):
            now = time.perf_counter()
            with self.lock:
                if self.jobs:
                    self.counts["busy_s"] += now - last
                for job in list(self.jobs):
                    self._produce(job, now)
            last = now

    def _produce(self, job: _Job, now: float) -> None:
        share = 1.0 if job.duration <= 0 else min((now - job.start) / job.duration, 1.0)
        for t, versions in zip(job.trajectories, job.versions, strict=True):
            due = int(share * len(t.loss_mask))
            for m in t.loss_mask[len(versions):due]:
                versions.append(self.version if m else -1)
                self.counts["generated_tokens"] += m
        if share >= 1.0:
            self.jobs.remove(job)
            self.done.put((job.key, [dataclasses.replace(t, policy_versions=v)
                                     for t, v in zip(job.trajectories, job.versions, strict=True)]))

    def update_weights(self, params, policy_version):
        with self.lock:
            self.version = policy_version
            self.received.append((policy_version, params))

    def wait(self, timeout):
        finished = []
        try:
            finished.append(self.done.get(timeout=timeout) if timeout != 0.0 else self.done.get_nowait())
            while True:
                finished.append(self.done.get_nowait())
        except queue.Empty:
            return finished

    def stats(self):
        with self.lock:
            return dict(self.counts)

    def close(self):
        self.stop.set()
        self.thread.join()


def make_async_scripted_rollout(*, max_delay: float = 0.02, delay_seed: int = 0,
                                vocab_size: int = TINY_VOCAB):
    """``make_scripted_rollout``'s rollout (its synchronous calls, e.g. the hard filter's) with a ``stream``
    method (:class:`ScriptedStream`); ``streams``: every stream it opened."""
    scripted = make_scripted_rollout(vocab_size=vocab_size)

    def rollout(*args, **kwargs):
        return scripted(*args, **kwargs)

    def stream(params, **options):
        rollout.streams.append(ScriptedStream(scripted, params, **options, max_delay=max_delay,
                                              delay_seed=delay_seed + len(rollout.streams)))
        return rollout.streams[-1]

    rollout.stream, rollout.streams = stream, []
    return rollout


def main(argv):
    from experiments import _launch
    from rstar2jax import train

    options = train.parse(_CONFIG.value)
    # The library's lines ("resuming RL ...", the process a cluster launch joined) on stdout, as a launcher's.
    with _launch.console_logging():
        train.prepare_process(options)
        if options.rl.schedule == "async":
            rollout_fn = make_async_scripted_rollout(max_delay=_DELAY.value)
        else:
            rollout_fn = make_scripted_rollout(delay=_DELAY.value)
        train.train_rl(options, rollout_fn=rollout_fn, max_steps=_MAX_STEPS.value)
    jax.effects_barrier()


if __name__ == "__main__":
    from absl import app, flags
    from ml_collections import config_flags

    _CONFIG = config_flags.DEFINE_config_dict("config", tiny_rl_config("runs/scripted"))
    _DELAY = flags.DEFINE_float(
        "delay", 0.0, "seconds each rollout call sleeps (gives a test time to kill it)"
    )
    _MAX_STEPS = flags.DEFINE_integer("max_steps", None, "stop after this many RL steps (default: all)")
    app.run(main)
