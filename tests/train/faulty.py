"""Test driver (issue 33): an RL run with faults injected, run as a launcher (``experiments._launch.run``: one
line and exit status 3 for a fault that stops it), so a test sees what a user sees.

  python -m tests.train.faulty --config.workdir=W --rollout=agent --config.tokenizer=DIR \
      --config.data.source=problems.jsonl --faults=2:blink,3:worker,4:death
  python -m tests.train.faulty --config.workdir=W --rollout=scripted --nan_steps=2,4,5
  python -m tests.train.faulty --config.workdir=W --rollout=scripted --disk_full_at_step=3

``--rollout=agent`` is the real agent rollout (:class:`~rstar2jax.agent.PolicyRollout`: every tool call
through a sandbox server this process starts, every answer graded by a verifier process pool) with scripted
sampling (:class:`ScriptedPolicyEngine`: token streams drawn from each group's seed), so runs are cheap and
deterministic. Faults, by rollout call (= step in one stage), fire at that call's first tool call, while the
other sessions' calls are on their way:

* ``blink``: the sandbox server is killed and started again on its port at once (as someone would by hand:
  the run does not own it here), and the verifier pool's workers are killed while they hold comparisons;
* ``worker``: the sandbox worker running a call is killed under it;
* ``death``: the sandbox server is killed for good (the outage budget of that call is ``--death_budget``).

``--reference_workdir=DIR`` first trains the same run without faults in ``DIR`` (in the same process: its
compiled programs come from the persistent cache), the numbers the faulty run is compared with.

``--rollout=scripted`` is ``tests.train.scripted``'s rollout; ``--nan_steps`` gives those steps NaN sampler
log-probs (a NaN loss and gradient); ``--disk_full_at_step`` makes that step's checkpoint run out of disk
while it writes its JSON record, after its arrays.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import signal
import threading
import time

import numpy as np

from rstar2jax.agent import PYTHON_TOOL_NAME, OutagePolicy, PolicyRollout, PromptConfig
from rstar2jax.data.conversation import encode_text
from tests.agent.test_rollout import ScriptedSession, call_text

PROMPT = PromptConfig(system_prompt="", user_prefix="",
                      tools=({"type": "function", "function": {"name": PYTHON_TOOL_NAME}},))
GOLD = "\\frac{1}{2}"  # not an integer: every answer goes through the verifier pool
CODES = ("import time\ntime.sleep(0.3)\nprint(1 / 2)", "print(1 / 0)")  # a slow call and a failing one
ANSWERS = ("\\frac{2}{4}", "\\frac{1}{3}", "0.5")
AGENT_MAX_RESPONSE = 160  # a call, its output and an answer fit


def problem_text(index: int) -> str:
    return f"Problem {index}: what is one half?"


def answer_text(answer: str) -> str:
    return f" So it is {answer}.</reason>\n<answer>\\boxed{{{answer}}}</answer><|im_end|>"


def one_stage_config(workdir: str, steps: int, max_response_length: int):
    """``tests.train.scripted``'s tiny recipe in one stage (one compiled step), a checkpoint after every step,
    progress lines only for steps with something to report."""
    from rstar2jax.config.config import stage
    from tests.train.scripted import tiny_rl_config

    c = tiny_rl_config(workdir)
    c.stages = [stage("stage1", steps=steps, max_response_length=max_response_length, max_turns=3)]
    c.checkpoint.save_every, c.checkpoint.keep = 1, steps
    c.logging.progress, c.logging.progress_every = True, 100
    return c


class ScriptedPolicyEngine:
    """The engine one :class:`ScriptedPolicyRollout` call samples with: each group's sessions replay streams
    drawn from the group's seed (a tool call from ``CODES``, then an answer from ``ANSWERS``)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.eos_ids = {tokenizer.convert_tokens_to_ids("<|im_end|>")}

    async def open(self, prompt_ids, n=1, *, sampling, max_tokens, seed=None):
        rng = np.random.default_rng([seed, len(prompt_ids)])
        scripts = [encode_text(self.tokenizer, call_text(CODES[rng.integers(len(CODES))])
                               + answer_text(ANSWERS[rng.integers(len(ANSWERS))])) for _ in range(n)]
        return [ScriptedSession(self, script, max_tokens) for script in scripts]

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc_info):
        return None


@dataclasses.dataclass(eq=False, repr=False)
class ScriptedPolicyRollout(PolicyRollout):
    """``PolicyRollout`` with scripted sampling; ``faults[k]()`` runs at the first tool call of its k-th call,
    whose outage budget is ``budgets[k]`` (default: the ``outage`` policy's)."""

    faults: dict = dataclasses.field(default_factory=dict)
    budgets: dict = dataclasses.field(default_factory=dict)
    calls: int = 0

    def __post_init__(self):
        super().__post_init__()
        self.default_budget = self.outage.budget_s

    def __call__(self, *args, **kwargs):
        self.calls += 1
        budget = self.budgets.get(self.calls, self.default_budget)
        self.outage = dataclasses.replace(self.outage, budget_s=budget)
        return super().__call__(*args, **kwargs)

    def make_engine(self, params, engine_config, policy_version):
        return ScriptedPolicyEngine(self.tokenizer)


class FaultySandbox:
    """A sandbox client whose rollout's fault for the current call fires before that call's first tool call
    goes out."""

    def __init__(self, client, rollout: ScriptedPolicyRollout):
        self.client, self.rollout, self.urls, self.fired = client, rollout, client.urls, set()

    async def run(self, code, stdin="", timeout=None):
        call = self.rollout.calls
        if call in self.rollout.faults and call not in self.fired:
            self.fired.add(call)
            self.rollout.faults[call]()
        return await self.client.run(code, stdin=stdin, timeout=timeout)

    async def close(self):
        await self.client.close()


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def agent_rollout(config, server, verifier, faults: dict[int, str], death_budget: float):
    """The scripted agent rollout on ``server`` (a ``sandbox_server.LocalServer``) with ``faults``."""
    from rstar2jax.agent import RolloutConfig, SandboxClient
    from rstar2jax.data.tokenizer import load_tokenizer
    from rstar2jax.engine import EngineConfig

    def blink():
        server.process.send_signal(signal.SIGKILL)
        server.process.wait()
        pids = verifier.worker_pids
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)  # they take this step's comparisons and hold them

        def later():
            print(f"fault: {server.restart_if_dead()}", flush=True)
            time.sleep(0.5)
            for pid in pids:
                _kill(pid)
            print(f"fault: killed the verifier workers {pids}", flush=True)

        threading.Thread(target=later).start()

    def worker():
        def kill():
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                busy = [w for w in server.get("/health")["workers"] if w["inflight"]]
                if busy:
                    _kill(busy[0]["pid"])
                    print(f"fault: killed the busy sandbox worker {busy[0]['pid']}", flush=True)
                    return
                time.sleep(0.01)

        threading.Thread(target=kill).start()

    def death():
        server.process.send_signal(signal.SIGKILL)
        server.process.wait()
        print("fault: killed the sandbox server for good", flush=True)

    actions = {"blink": blink, "worker": worker, "death": death}
    rollout = ScriptedPolicyRollout(
        None, load_tokenizer(config.tokenizer), None, engine_config=EngineConfig(num_slots=16),
        max_prompt_length=config.batch.max_prompt_length,
        config=RolloutConfig(prompt=PROMPT, tool_timeout=10.0), verifier=verifier,
        outage=OutagePolicy(budget_s=config.rollout.sandbox_outage_s, backoff=(0.05, 0.5)),
        faults={step: actions[name] for step, name in faults.items()},
        budgets={step: death_budget for step, name in faults.items() if name == "death"})
    rollout.sandbox = FaultySandbox(SandboxClient(server.url), rollout)
    return rollout


def nan_rollout(nan_steps: set[int]):
    """``tests.train.scripted``'s rollout with NaN sampler log-probs at the calls in ``nan_steps``."""
    from tests.train.scripted import make_scripted_rollout

    scripted = make_scripted_rollout()
    calls = 0

    def rollout(params, problems, **kwargs):
        nonlocal calls
        calls += 1
        trajectories = scripted(params, problems, **kwargs)
        if calls in nan_steps:
            trajectories = [dataclasses.replace(t, logprobs=[float("nan")] * len(t.logprobs))
                            for t in trajectories]
        return trajectories

    return rollout


def disk_full_at(step: int) -> None:
    """Checkpoint ``step`` runs out of disk half-way: its arrays are written, its JSON record is not."""
    import orbax.checkpoint as ocp

    save_json = ocp.JsonCheckpointHandler._save_fn

    async def save(self, x, directory):
        if os.path.basename(os.path.dirname(str(directory))).startswith(f"{step}."):
            path = directory / "metadata"
            path.write_text('{"half')
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return await save_json(self, x, directory)

    ocp.JsonCheckpointHandler._save_fn = save


def _steps(text: str) -> list[int]:
    return [int(s) for s in text.split(",") if s]


def main(argv):
    import contextlib

    from rstar2jax import train
    from rstar2jax.reward import AnswerVerifier
    from sandbox_server import start_local

    config = _CONFIG.value
    config.stages[0].steps = config.checkpoint.keep = _STEPS.value
    config.stages[0].max_response_length = _MAX_RESPONSE.value
    options = train.parse(config)
    train.prepare_process(options)
    if _DISK_FULL_AT.value:
        disk_full_at(_DISK_FULL_AT.value)
    with contextlib.ExitStack() as stack:
        if _ROLLOUT.value == "agent":
            server = stack.enter_context(start_local(workers=1, slots=4))
            verifier = stack.enter_context(AnswerVerifier(num_workers=1))
            print(f"sandbox: {server.url}", flush=True)

        def make_rollout(faulty: bool):
            if _ROLLOUT.value == "scripted":
                return nan_rollout(set(_steps(_NAN_STEPS.value)) if faulty else set())
            faults = {int(k): v for k, v in (item.split(":") for item in _FAULTS.value)} if faulty else {}
            rollout = agent_rollout(config, server, verifier, faults, _DEATH_BUDGET.value)
            stack.callback(rollout.close)
            return rollout

        if _REFERENCE.value:
            reference = config.copy_and_resolve_references()
            reference.workdir = _REFERENCE.value
            train.train_rl(train.parse(reference), rollout_fn=make_rollout(faulty=False))
        train.train_rl(options, rollout_fn=make_rollout(faulty=True))


if __name__ == "__main__":
    from absl import flags
    from ml_collections import config_flags

    from experiments import _launch

    _CONFIG = config_flags.DEFINE_config_dict("config", one_stage_config("runs/faulty", 4, 24))
    _STEPS = flags.DEFINE_integer("steps", 4, "RL steps (one stage)")
    _MAX_RESPONSE = flags.DEFINE_integer("max_response_length", 24, "the stage's response budget")
    _ROLLOUT = flags.DEFINE_enum("rollout", "scripted", ["scripted", "agent"], "which rollout")
    _FAULTS = flags.DEFINE_list("faults", [], "agent rollout: STEP:blink|worker|death, ...")
    _REFERENCE = flags.DEFINE_string("reference_workdir", "", "first train the run without faults here")
    _DEATH_BUDGET = flags.DEFINE_float("death_budget", 1.0, "outage budget of the call whose sandbox dies")
    _NAN_STEPS = flags.DEFINE_string("nan_steps", "", "scripted rollout: steps with NaN log-probs, e.g. 2,4")
    _DISK_FULL_AT = flags.DEFINE_integer("disk_full_at_step", 0, "the checkpoint of this step fails half-way")
    _launch.run(main)
