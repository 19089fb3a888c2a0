"""Bad run-config values, field by field, and a driver that gives each to a launcher as a user would.

``bad_values(config, kind)`` walks every scalar field of a config (from the config itself: a field added later
is walked too) and pairs it with the bad values its schema check declares (``Check.bad``: negative, zero where
positive is required, a string where a number or a flag belongs, an unknown choice) and, for a field naming a
file, a path that does not exist. A field with no schema entry, or whose check refuses nothing and that is
not free text, fails the walk. ``CONTRADICTIONS`` are values each allowed alone that contradict another field.

The driver runs ``python -m <launcher> --config=<file> --config.<field>=<value> ...`` once per case, each in a
process forked from one that imported the library once (a launcher's start costs a fork, not an interpreter
and JAX's import), and prints per case its exit status, stderr and whether the work folder appeared:

  python -m tests.train.bad_options experiments.train_rl experiments/configs/tiny_cpu.py cases.json ROOT

A case is a list of overrides, stopped where the launcher goes past parsing (``train.prepare_process``), or
``{"args": [...], "refuse": "module:function"}``: that library function made to answer False in the case's
process (what this backend can run, e.g. ``models.platform.float8_supported``), stopped where the launcher
announces its work folder (after checking the rollout's precision on the backend).
"""

from __future__ import annotations

import json
import os
import re
import runpy
import sys
import traceback
from typing import Any

#: Fields any string is a valid value of (names of data columns, free prose, an address checked against
#: another field): the walk sets nothing bad for them.
FREE_TEXT = {
    "notice",
    "prompt.system_prompt",
    "prompt.user_prefix",
    "data.problem_field",
    "data.answer_field",
    "data.solution_field",
    "data.id_field",
    "distributed.coordinator_address",
    "logging.wandb.name",
}
MISSING_FILE = "/nonexistent/rstar2jax/missing.jsonl"

#: Values each allowed alone that contradict another field of ``tiny_cpu``'s configs: (kind, overrides,
#: the start of the one line naming them).
CONTRADICTIONS = [
    ("rl", {"rl.keep": 5}, "config.rl.keep=5: must be an integer in [1, rl.samples_per_problem=4]"),
    ("rl", {"rl.overlong_buffer": 65}, "config.rl.overlong_buffer=65 is longer than stages[0]"),
    ("rl", {"batch.pack": False, "rl.prompts_per_step": 3, "num_microbatches": 4}, "config.rl.prompts_per"),
    ("rl", {"model.lora.rank": 4, "model.lora.dropout": 0.1}, "config.model.lora.dropout=0.1: must be 0"),
    ("rl", {"loss.rollout_is_cap": 2.0}, "config.loss.rollout_is_cap / loss.rollout_mask"),
    ("rl", {"rl.off_policy_steps": 1}, "config.rl.off_policy_steps=1 trains on tokens an older policy"),
    ("rl", {"rollout.partial_token_budget": 64}, "config.rollout.partial_token_budget > 0 trains on tokens"),
    ("rl", {"rollout.engine_slots": 3}, "config.rollout.engine_slots=3: must be at least"),
    # A low-precision rollout (issue 41); what the backend cannot run: tests/train/test_rollout_precision.py.
    ("rl", {"rollout.weight_dtype": "fp8"}, "config.rollout.weight_block=128: FP8 weight block 128 does not"),
    ("rl", {"rollout.weight_dtype": "fp8", "rollout.weight_block": 48}, "config.rollout.weight_block=48: "),
    ("rl", {"rollout.quantize_head": True}, "config.rollout.quantize_head=True: quantize_head=True needs"),
    ("rl", {"rollout.kv_dtype": "fp8", "loss.rollout_is_cap": None},
     "config.loss.rollout_is_cap=None: the rollout samples with fp8 KV pages while the trainer computes in"),
    ("rl", {"rollout.kv_dtype": "bfloat16", "loss.old_logprobs": "sampler"},
     "config.loss.old_logprobs='sampler': the rollout samples with bfloat16 KV pages"),
    ("rl", {"stages[1].hard_filter_rollouts": 9}, "config.stages[1].hard_filter_rollouts=9: must be at most"),
    ("rl", {"rollout.kv_cache_tokens": 100}, "config.rollout.kv_cache_tokens=100: must be 0"),
    ("rl", {"distributed.num_processes": 1, "distributed.process_id": 1},
     "config.distributed.process_id=1: must be in [0"),
    # num_processes "auto" (the default): the cluster's environment gives each process its id (issue 54).
    ("rl", {"distributed.process_id": 1}, "config.distributed.process_id=1: the cluster says each process"),
    ("rl", {"distributed.num_processes": 2}, "config.distributed.coordinator_address=''"),
    ("rl", {"data.source": ""}, "config.data.source is empty and config.stages[0].dataset names no dataset"),
    ("rl", {"model.preset": ""}, "config.model.spec: "),
    ("sft", {"model.lora.rank": 4096}, "config.model.lora.rank=4096: lora rank=4096 is larger than"),
    ("sft", {"distributed.num_processes": 2, "distributed.coordinator_address": "host0:1234",
             "distributed.process_id": 2}, "config.distributed.process_id=2: must be in [0"),
]

#: What the backend cannot run (issue 41), each made so on this CPU (which runs FP8) by the library's own
#: probe answering False: (overrides, the probe ``module:function``, the start of the one line naming it).
BACKEND_REFUSALS = [
    ({"rollout.weight_dtype": "fp8", "rollout.weight_block": 32},
     "rstar2jax.models.platform:float8_supported",
     "config.rollout.weight_dtype='fp8': weight_dtype='fp8' needs float8_e4m3fn, which JAX"),
    ({"rollout.kv_dtype": "fp8"}, "rstar2jax.models.platform:float8_supported",
     "config.rollout.kv_dtype='fp8': kv_dtype='fp8' needs float8_e4m3fn, which JAX"),
    ({"rollout.kv_dtype": "fp8", "rollout.attention": "pallas_triton"},
     "rstar2jax.engine.paged_attention:pallas_reads_fp8",
     "config.rollout.attention='pallas_triton': attention='pallas_triton' cannot read FP8 KV pages"),
]


def scalar_fields(node, prefix: str = "") -> list[tuple[str, Any]]:
    """(path, value) of every leaf that is not a section: ``stages[i].x`` for a stage's, ``model.spec.x``
    for the inline model's; a tuple of values (``model.lora.targets``) is one leaf."""
    leaves = []
    for key, value in node.items():
        path = f"{prefix}{key}"
        if hasattr(value, "items"):
            leaves += scalar_fields(value, path + ".")
        elif isinstance(value, list) and value and all(hasattr(v, "items") for v in value):
            for index, item in enumerate(value):
                leaves += scalar_fields(item, f"{path}[{index}].")
        else:
            leaves.append((path, value))
    return leaves


def _field(path: str, kind: str):
    from rstar2jax.config import schema, schema_rl

    stage = re.match(r"stages\[\d+\]\.(\w+)$", path)
    return schema_rl.STAGE.get(stage.group(1)) if stage else schema.fields(kind).get(path)


def bad_values(config, kind: str) -> list[tuple[str, Any]]:
    """(path, bad value) for every scalar field of ``config`` (see the module doc)."""
    cases = []
    for path, value in scalar_fields(config):
        if path.startswith("model.spec."):  # ModelConfig's own fields: its checks, named by the parser
            cases += [(path, 0), (path, "x")] if isinstance(value, int) else [(path, (-1,))]
            continue
        field = _field(path, kind)
        assert field is not None, f"config.{path} has no schema entry: declare it with its check"
        bad = list(field.check.bad) + ([MISSING_FILE] if field.exists else [])
        assert bad or path in FREE_TEXT, f"config.{path}: its check refuses nothing; declare bad values"
        cases += [(path, b) for b in bad]
    return cases


def set_path(config, path: str, value: Any) -> None:
    """``config.<path> = value`` (``stages[1].steps`` included)."""
    *parents, leaf = re.sub(r"\[(\d+)\]", r".\1", path).split(".")
    node = config
    for part in parents:
        node = node[int(part)] if part.isdigit() else node[part]
    node[leaf] = value


def override(path: str, value: Any) -> str:
    """The command-line override setting ``value``, as a user types it."""
    return f"--config.{path}={'' if value == '' else value}"


class _Accepted(Exception):
    """The launcher went past parsing the config: the value was accepted (nothing may run)."""


def _refuse(probe: str) -> None:
    """Makes the library function ``probe`` ("module:function") answer False, and the launcher stop (as
    accepted) where it announces its work folder, after checking what the backend runs."""
    import importlib

    from experiments import _launch

    module, name = probe.split(":")
    setattr(importlib.import_module(module), name, lambda *args, **kwargs: False)

    def accepted(*args, **kwargs):
        raise _Accepted

    _launch.announce = accepted


def _run_case(launcher: str, args: list[str], refuse: str = "") -> tuple[int, str]:
    """Forks, runs ``python -m launcher *args`` in the child (with ``_refuse(refuse)`` first when given) and
    returns its exit status and stderr."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the launcher as ``python -m`` runs it
        os.close(read)
        os.dup2(write, 2)
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
        sys.argv = [launcher, *args]
        status = 0
        try:
            if refuse:
                _refuse(refuse)
            runpy.run_module(launcher, run_name="__main__", alter_sys=True)
        except SystemExit as exit_:
            code = exit_.code
            status = code if isinstance(code, int) else (0 if code is None else 1)
            if isinstance(code, str):
                print(code, file=sys.stderr)
        except _Accepted:
            status = 99
        except BaseException:  # what the interpreter does with an uncaught exception
            traceback.print_exc()
            status = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    os.close(write)
    with os.fdopen(read, encoding="utf-8", errors="replace") as pipe:
        stderr = pipe.read()
    _, wait_status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(wait_status), stderr


def main(argv: list[str]) -> None:
    launcher, config_file, cases_file, root = argv[1:5]
    import experiments._launch  # noqa: F401  what every launcher imports, once for all the cases
    from rstar2jax import train
    from rstar2jax.agent import outage  # noqa: F401

    prepare_process = train.prepare_process

    def accepted(options):
        raise _Accepted

    results = []
    with open(cases_file, encoding="utf-8") as f:
        cases = json.load(f)
    for index, case in enumerate(cases):
        overrides, refuse = (case["args"], case["refuse"]) if isinstance(case, dict) else (case, "")
        # The first thing a launcher does after parsing: stop there, unless the case goes on to the backend.
        train.prepare_process = prepare_process if refuse else accepted
        workdir = os.path.join(root, f"case{index}")
        args = [f"--config={config_file}", "--compilation_cache_dir=", *overrides]
        if not any(arg.startswith("--config.workdir=") for arg in overrides):
            args.append(f"--config.workdir={workdir}")
        status, stderr = _run_case(launcher, args, refuse)
        wrote = os.path.exists(workdir)
        results.append({"args": overrides, "status": status, "stderr": stderr, "wrote": wrote})
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv)
