"""GPU acceptance in one call: whatever accelerator JAX finds (CUDA, ROCm, or the CPU) into one table and one
JSON file, in stages that each run in their own process under their own time limit.

  python -m experiments.accelerator_check                       # every stage, 540 s in all
  python -m experiments.accelerator_check --smoke               # tiny shapes on the CPU (the tests run it)
  python -m experiments.accelerator_check --stages=exact --budget_s=300   # every exact-numerics figure
  python -m experiments.accelerator_check --stages=environment,training --budget_s=300

It installs nothing and needs no network: run it from a checkout with the machine's own JAX
(``PYTHONPATH=. python -m experiments.accelerator_check``, or after ``pip install --no-deps -e .``).

Stages, in order (``STAGES``); each gets its share of the time left (``--budget_s``), so a stage that ends
early leaves more to the ones after it, and none can starve the rest beyond its share:

- ``environment``: Python, JAX, jaxlib and plugin versions (and whether this JAX is in the supported range),
  devices and their memory, the library's dependencies present or missing, and what ``"auto"`` picks for the
  training attention (``models.attention.auto_choice``: which kernel, why, which were passed over) and for
  the engine's paged decode attention;
- ``tests``: the test suite's accelerator subset (models, attention, log-probs, engine, train steps, packing,
  colocation; not the sandbox tests) as ``JAX_PLATFORMS=<backend> python -m pytest``, failures listed;
- ``training``: ``rl_step`` (GRPO loss, gradient, clip, AdamW; fp32 master weights, bf16 compute, remat
  full) of Qwen3-1.7B at 8 x 8,192 and 16 x 2,048 tokens with the ``"auto"`` attention, then with the
  portable blockwise one: compile seconds, tokens/s and MFU (``bench_train``'s model FLOPs over the
  device's dense bf16 peak); then the attention kernels alone, forward and backward at 8 x 8,192;
- ``exact``: exact numerics (issue 52, ``numerics="exact"``) by ``bench_exact``'s measurements (those of
  ``bench_engine --exact``) on the Qwen3-1.7B shape computing in bfloat16, random weights: the engine's
  sampled-token log-probs against the trainer's, then exact over default decode tokens/s at batch 1 and 16
  and ``rl_step`` tokens/s, then the float32 mismatch if the stage's time allows (its share is small: the
  default run may record only the first figures; ``--stages=exact --budget_s=300`` gives it the time); the
  ``"auto"`` choice of exact mode's kernels (``models.exact_kernels``: the Pallas Triton kernels on a CUDA or
  ROCm GPU) runs, and ``exact_kernels`` records which ran;
- ``engine``: the Qwen3-1.7B shape in bfloat16, random weights: time to a ready engine (a cold engine's first
  token at 64 slots), the decode step over the memory-bandwidth floor at batch 1 and 64 (parameter + KV
  bytes / measured device copy bandwidth; ``bench_engine``'s measurement), KV bytes held over tokens held,
  a 512-token prompt forked into 16 samples, and decode tokens/s of the FP8 engine (weights and KV pages)
  over the bfloat16 one at 64 slots where the backend multiplies float8 natively;
- ``loop``: two colocated RL steps of ``experiments/configs/qwen3_1p7b_1gpu.py`` (4 prompts x 16 samples,
  1,024-token responses, random weights, the real engine, sandbox and verifier), compile seconds
  (JAX's own compile events) apart from step time; generated tokens/s per GPU.

Each stage writes its figures as it gets them (``<output_dir>/stage_<name>.json``) and the run folds them
into ``<output_dir>/accelerator_check.json`` after every stage, so a killed run keeps every finished figure.
A stage that needs a module the machine lacks fails naming it while the others run (a pure-Python one can
be put on ``PYTHONPATH`` as its wheel file). SIGTERM or Ctrl-C stops the running stage with everything it
started, keeps what it recorded and exits 130. ``--smoke`` runs every stage at tiny shapes (the CPU;
``smoke_ok`` says every stage passed). The last printed line is the JSON: every figure, the device, and per
stage its status, seconds and limit.

JSON keys (contract): ``smoke_ok``, ``device``, ``gpu_tests_failed`` (and ``gpu_tests_passed``,
``gpu_tests_failures``), ``decode_step_over_floor_b1`` / ``_b64`` (goal <= 1.5), ``engine_ready_s``,
``kv_bytes_ratio``, ``group_prompt_kv_ratio``, ``fp8_decode_speedup`` (goal >= 1.2 on an H100; None with
``fp8_decode_why`` where the backend has no native FP8 matmul), ``mfu_8k`` (goal >= 0.35 on an H100),
``mfu_2k`` (>= 0.40), ``mfu_8k_blockwise``, ``mfu_2k_blockwise``, ``rl_step_tokens_per_s_8k`` (and ``_2k``,
``_blockwise``), ``training_attention``, ``rl_step_generated_tokens_per_s_per_gpu`` beside
``nemo_rl_generated_tokens_per_s_per_gpu`` (NeMo-RL's published 1,562 for an 8B GRPO step on H100s),
``exact_mismatch_max_bf16`` and ``exact_mismatch_max_fp32`` (goal 0.0; the latter None with
``exact_mismatch_fp32_why`` when the stage has no time left for it), ``exact_decode_ratio`` (goal >= 0.9; the
smaller of ``exact_decode_ratio_b1`` / ``_b16``, beside ``exact_decode_tokens_per_s_b1`` / ``_b16`` and
``default_decode_tokens_per_s_b1`` / ``_b16``), ``exact_train_ratio`` (goal >= 0.9), ``exact_kernels``
(``"pallas_triton"`` or ``"xla"``).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable

from absl import app, flags, logging

REPO = pathlib.Path(__file__).resolve().parents[1]
RESULT_FILE = "accelerator_check.json"
# NeMo-RL's published GRPO throughput for an 8B model on H100s (generated tokens/s per GPU), for comparison.
NEMO_RL_TOKENS_PER_S_PER_GPU = 1562


@dataclasses.dataclass(frozen=True)
class Stage:
    """``share``: the stage's fraction of the time left when it starts (against the stages still to run);
    ``smoke_s``: its time limit under ``--smoke`` with the default budget (scaled with ``--budget_s``)."""

    name: str
    share: float
    smoke_s: float
    description: str


STAGES = (
    Stage("environment", 0.08, 60, "versions, devices, memory, the 'auto' attention picks"),
    Stage("tests", 0.20, 90, "the test suite's accelerator subset"),
    Stage("training", 0.28, 90, "rl_step tokens/s and MFU, Qwen3-1.7B bf16"),
    Stage("exact", 0.06, 60, "exact numerics: engine = trainer log-probs and their cost, Qwen3-1.7B bf16"),
    Stage("engine", 0.16, 90, "decode step over the bandwidth floor, Qwen3-1.7B bf16"),
    Stage("loop", 0.22, 120, "two colocated RL steps of qwen3_1p7b_1gpu.py"),
)
STAGE_NAMES = tuple(s.name for s in STAGES)
#: ``--smoke``'s default budget; a larger ``--budget_s`` (a loaded machine) scales each stage's smoke limit.
SMOKE_BUDGET_S = 160.0

_OUTPUT_DIR = flags.DEFINE_string("output_dir", "runs/accelerator_check", "folder of the JSON files")
_BUDGET_S = flags.DEFINE_float("budget_s", None, "seconds for all stages (default 540; --smoke 160)")
_SMOKE = flags.DEFINE_bool("smoke", False, "every stage at tiny shapes (CPU), to check the script runs")
_STAGES = flags.DEFINE_list("stages", list(STAGE_NAMES), f"stages to run, of {', '.join(STAGE_NAMES)}")
_STAGE = flags.DEFINE_enum("stage", None, STAGE_NAMES, "internal: run this one stage in this process")
_STAGE_LIMIT_S = flags.DEFINE_float("stage_limit_s", 0.0, "internal: the time limit of --stage")

# Import names of the packages the library and its tests import, and optional ones worth reporting.
_MODULES = (
    "jax", "jaxlib", "flax", "optax", "orbax.checkpoint", "numpy", "transformers", "tokenizers",
    "safetensors", "datasets", "msgpack", "aiohttp", "absl", "ml_collections", "math_verify", "sympy", "tqdm",
    "tensorboardX", "matplotlib", "tokamax", "pytest", "xdist", "hypothesis", "torch",
)


class MissingModule(Exception):
    """A module a stage needs is not installed here (the stage fails naming it; the others run)."""


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a dotted name whose parent package is missing
        return False


def _require(*modules: str) -> None:
    missing = [m for m in modules if not _installed(m)]
    if missing:
        raise MissingModule(f"missing module{'s' * (len(missing) > 1)} {', '.join(missing)}")


def _write_json(path: pathlib.Path, value: dict) -> None:
    """Written whole or not at all (a killed writer leaves the previous file)."""
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(value, indent=1, default=str) + "\n", encoding="utf-8")
    os.replace(temporary, path)


class Recorder:
    """A stage's figures, written to its JSON file at every update."""

    def __init__(self, path: pathlib.Path):
        self.path, self.figures = path, {}

    def __call__(self, **figures) -> None:
        self.figures.update(figures)
        _write_json(self.path, self.figures)


# ---- stages (each runs in its own process: python -m experiments.accelerator_check --stage=NAME)


def stage_environment(record: Recorder, smoke: bool) -> None:
    del smoke  # the same on every backend
    import jax

    from rstar2jax.models import attention
    from rstar2jax.models.platform import SUPPORTED_JAX, accelerator, jax_version_supported

    distributions = {d.metadata["Name"].lower().replace("_", "-"): d.version
                     for d in importlib.metadata.distributions() if d.metadata["Name"]}
    plugins = {name: version for name, version in distributions.items()
               if re.match(r"jax-(cuda|rocm)\d*-(plugin|pjrt)", name)}
    modules, missing = {}, []
    for name in _MODULES:
        if not _installed(name):
            missing.append(name)
        else:
            top = {"absl": "absl-py", "xdist": "pytest-xdist", "orbax.checkpoint": "orbax-checkpoint",
                   "ml_collections": "ml-collections", "math_verify": "math-verify"}.get(name, name)
            modules[name] = distributions.get(top.lower().replace("_", "-"), "?")
    devices = jax.devices()
    stats = devices[0].memory_stats() or {}
    backend = accelerator()
    record(
        python=platform.python_version(),
        jax=jax.__version__,
        jaxlib=distributions.get("jaxlib", "?"),
        jax_plugins=plugins,
        jax_supported=jax_version_supported(jax.__version__),
        jax_supported_range=",".join(SUPPORTED_JAX),
        backend=backend,
        device=f"{devices[0].device_kind} ({backend}, {len(devices)} device{'s' * (len(devices) > 1)})",
        device_kind=devices[0].device_kind,
        device_count=len(devices),
        device_memory_gib=round(stats["bytes_limit"] / 2**30, 2) if "bytes_limit" in stats else None,
        host_memory_gib=round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        cpu_count=os.cpu_count(),
        modules=modules,
        missing_modules=missing,
        commit=_git_commit(),
    )
    print(f"device: {record.figures['device']}; JAX {jax.__version__} (supported "
          f"{record.figures['jax_supported']}), plugins {plugins or 'none'}", flush=True)
    print(f"missing modules: {', '.join(missing) or 'none'}", flush=True)
    choice = attention.auto_choice(128, "bfloat16")  # the Qwen3 head dimension, the training compute dtype
    record(training_attention=choice.implementation, training_attention_why=choice.reason,
           training_attention_rejected=dict(choice.rejected))
    print(f"training attention 'auto': {choice.implementation} ({choice.reason})", flush=True)
    for name, why in choice.rejected:
        print(f"  passed over {name}: {why}", flush=True)
    # The paged decode attention's pick (the same resolver, its rule per accelerator).
    rule = ", ".join(f"{name} on {platform_}" for platform_, name in attention.DECODE_AUTO.items())
    record(paged_attention_auto=attention.resolve_attention("auto", use="decoding"),
           paged_attention_why=f"'auto' decodes with {rule}, blockwise elsewhere")
    print(f"paged decode attention 'auto': {record.figures['paged_attention_auto']}", flush=True)


def _git_commit() -> str | None:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        return None
    done = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=False)
    return done.stdout.strip() or None


# The accelerator subset: everything that runs models, attention, log-probs, the engine, train steps and
# colocation on the device; not the sandbox (its isolation needs what a GPU VM may not offer).
TEST_PATHS = ("tests/models", "tests/engine", "tests/train/test_steps.py", "tests/train/test_packing.py",
              "tests/train/test_colocate.py")
# Smoke: one quick device test, to check the stage's mechanics (pytest, its report, the listing).
SMOKE_TEST_PATHS = (
    "tests/algo/test_advantages.py::test_grpo_unit_std_and_zero_mean_on_valid_entries[unbiased-1]",
)
# A test's outcome in pytest -v output: "tests/x.py::t PASSED [ 3%]", or with xdist "[gw0] [ 3%] PASSED
# tests/x.py::t".
_OUTCOMES = "PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS"
_TEST_LINE = re.compile(rf"\b(?P<before>{_OUTCOMES})\b.*?(?P<id1>tests/\S+::\S+)|(?P<id2>tests/\S+::\S+)\s+"
                        rf"(?P<after>{_OUTCOMES})\b")


def stage_tests(record: Recorder, smoke: bool) -> None:
    _require("pytest")
    from rstar2jax.models.platform import accelerator

    backend = accelerator()
    junit = pathlib.Path(_OUTPUT_DIR.value).resolve() / "tests_junit.xml"
    junit.unlink(missing_ok=True)
    workers = 0 if smoke or not _installed("xdist") else min(8, os.cpu_count() or 1)
    command = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider",
               "--continue-on-collection-errors", f"--junitxml={junit}",
               *(["-n", str(workers)] if workers else []), *(SMOKE_TEST_PATHS if smoke else TEST_PATHS)]
    # Several test processes share the device: each allocates what it uses instead of most of its memory.
    env = {**os.environ, "JAX_PLATFORMS": backend if backend in ("cuda", "rocm", "tpu") else "cpu",
           "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    record(tests_command=f"JAX_PLATFORMS={env['JAX_PLATFORMS']} {' '.join(command[1:])}",
           tests_workers=workers)
    print(record.figures["tests_command"], flush=True)
    outcomes: dict[str, str] = {}

    def on_line(line: str) -> None:
        match = _TEST_LINE.search(line)
        if match:
            outcomes[match["id1"] or match["id2"]] = match["before"] or match["after"]

    # Leave the stage a few seconds to record what finished if pytest runs out of time.
    returncode = _run_streaming(command, env=env, timeout=max(_STAGE_LIMIT_S.value - 15, 10),
                                on_line=on_line, prefix="  ")
    failures = _junit_failures(junit) if junit.exists() else {
        name: "(no report: pytest was stopped at the stage's time limit)"
        for name, status in outcomes.items() if status in ("FAILED", "ERROR")}
    counts = collections.Counter(outcomes.values())
    # pytest's exit status: 0 all passed, 1 some failed; anything else means the tests did not run as meant
    # (interrupted, an internal or usage error, nothing collected), so no failure count stands.
    ran = returncode in (0, 1)
    record(
        gpu_tests_failed=len(failures) if ran else None,
        gpu_tests_passed=counts["PASSED"],
        gpu_tests_skipped=counts["SKIPPED"],
        gpu_tests_failures=failures,
        gpu_tests_complete=ran,
        tests_backend=env["JAX_PLATFORMS"],
    )
    if returncode is None:
        raise TimeoutError(f"pytest did not finish in the stage's time ({len(outcomes)} tests ran)")
    if not ran:
        raise RuntimeError(f"pytest exited with status {returncode} (see its output above)")


def _junit_failures(path: pathlib.Path) -> dict[str, str]:
    """test id -> the first line of its failure or error, from pytest's JUnit XML."""
    failures = {}
    for case in ElementTree.parse(path).iter("testcase"):
        problem = next((child for child in case if child.tag in ("failure", "error")), None)
        if problem is None:
            continue
        module = case.get("classname", "").replace(".", "/")
        name = f"{module}.py::{case.get('name')}" if module else case.get("name", "?")
        message = (problem.get("message") or "").strip().splitlines()
        # A collection error's message says only that; the exception is the last "E " line of its report.
        raised = [line[1:].strip() for line in (problem.text or "").splitlines() if line.startswith("E ")]
        if raised and (not message or message[0] == "collection failure"):
            message = raised[-1:]
        failures[name] = message[0][:300] if message else problem.tag
    return failures


def _run_streaming(command: list[str], *, env: dict, timeout: float,
                   on_line: Callable[[str], None] | None = None, prefix: str = "") -> int | None:
    """Runs ``command`` in its own process group, printing its output as it comes (each line through
    ``on_line``); returns its exit status, or None when it ran past ``timeout`` (the group is then killed)."""
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, errors="replace", start_new_session=True)

    def pump():
        for line in process.stdout:
            print(prefix + line.rstrip(), flush=True)
            if on_line is not None:
                on_line(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        returncode = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(process)
        returncode = None
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the command's whole group goes too
        _kill_group(process)
        raise
    reader.join(timeout=5)
    return returncode


def _kill_group(process: subprocess.Popen) -> None:
    """SIGTERM to the process's group (its own children too), SIGKILL after 5 s."""
    for sig, grace in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        try:
            process.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def stage_engine(record: Recorder, smoke: bool) -> None:
    import functools

    import jax
    import numpy as np

    from experiments import bench_engine
    from rstar2jax.engine import EngineConfig, generate

    shape = "tiny" if smoke else "1.7b"
    config, params = bench_engine._model(shape, "bfloat16")
    record(engine_model=f"{shape} bfloat16 random weights")
    # A cold engine's first token: building it, compiling the step programs it needs, one step.
    prompt = np.random.default_rng(0).integers(0, config.vocab_size, 128).tolist()
    start = time.perf_counter()
    generate(params, config, [prompt], max_new_tokens=1,
             engine_config=EngineConfig(num_slots=64, max_len=2048, eos_token_ids=()))
    record(engine_ready_s=round(time.perf_counter() - start, 2))
    print(f"time to a ready engine (64 slots, first token of a 128-token prompt): "
          f"{record.figures['engine_ready_s']} s", flush=True)
    gpu = jax.default_backend() != "cpu"
    measure_bandwidth = (bench_engine.device_copy_bandwidth if gpu
                         else functools.partial(bench_engine.copy_bandwidth, repeats=2))
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    held = 64 if smoke else 512
    for batch in (1, 64):
        step = bench_engine.step_over_floor(params, config, batch=batch, held=held, param_bytes=param_bytes,
                                            measure_bandwidth=measure_bandwidth)
        ratio = step["step_s"] / step["floor_s"]
        record(**{f"decode_step_over_floor_b{batch}": round(ratio, 3),
                  f"decode_step_ms_b{batch}": round(step["step_s"] * 1e3, 3),
                  f"decode_floor_ms_b{batch}": round(step["floor_s"] * 1e3, 3),
                  "copy_bandwidth_gb_s": round(step["bandwidth"] / 1e9, 1)})
        if batch == 64:
            record(kv_bytes_ratio=round(step["kv"]["kv_bytes"] / step["kv"]["token_bytes"], 3))
        print(f"decode step, batch {batch}, {held} tokens held: {step['step_s'] * 1e3:.2f} ms, floor "
              f"{step['floor_s'] * 1e3:.2f} ms: {ratio:.2f}x", flush=True)
    group = bench_engine.group_prompt_kv(params, config)
    record(group_prompt_kv_ratio=round(group["kv_bytes"] / group["token_bytes"], 3))
    fp8_decode(record, smoke)


def fp8_decode(record: Recorder, smoke: bool) -> None:
    """``fp8_decode_speedup``: decode tokens/s of the FP8 engine (weights and KV pages) over the bfloat16
    one, 64 sequences holding 512 tokens, Qwen3-1.7B shape (``bench_engine.fp8_decode_rates``), where the
    backend has float8 and multiplies it natively (``models.platform``'s probes; elsewhere, the CPU
    included, the figure is None and ``fp8_decode_why`` says why). ``--smoke``: the tiny shape at 4 x 32
    tokens."""
    from experiments import bench_engine
    from rstar2jax.models import platform as probes

    why = ""
    if not probes.float8_supported():
        why = "no float8_e4m3fn on this backend"
    elif not probes.fp8_matmul_native():
        why = "no native FP8 matmul on this backend (its FP8 engine dequantizes: the portable path)"
    if why:
        record(fp8_decode_speedup=None, fp8_decode_why=why)
        print(f"FP8 decode speedup: not measured, {why}", flush=True)
        return
    slots, held = (4, 32) if smoke else (64, 512)
    rates = bench_engine.fp8_decode_rates("tiny" if smoke else "1.7b", slots=slots, prompt_len=held)
    record(fp8_decode_speedup=round(rates["fp8"] / rates["bf16"], 3),
           fp8_weights_decode_speedup=round(rates["fp8_weights"] / rates["bf16"], 3),
           fp8_kv_decode_speedup=round(rates["fp8_kv"] / rates["bf16"], 3),
           fp8_decode_tokens_per_s=round(rates["fp8"], 1), bf16_decode_tokens_per_s=round(rates["bf16"], 1))
    print(f"decode tokens/s, {slots} slots x {held} tokens held: FP8 {rates['fp8']:.0f}, bfloat16 "
          f"{rates['bf16']:.0f}: {rates['fp8'] / rates['bf16']:.2f}x (FP8 weights alone "
          f"{rates['fp8_weights']:.0f}, FP8 KV alone {rates['fp8_kv']:.0f})", flush=True)


def stage_exact(record: Recorder, smoke: bool) -> None:
    # The stage's own clock: what it measures last (float32's mismatch) runs only if it fits.
    exact_numerics(record, smoke, deadline=time.perf_counter() + _STAGE_LIMIT_S.value - 10)


def exact_numerics(record: Recorder, smoke: bool, deadline: float) -> None:
    """Exact numerics (issue 52) by ``bench_exact``'s measurements, on the Qwen3-1.7B shape (random weights,
    float32 master weights) computing in bfloat16; ``--smoke``: its tiny shape. In order, each recorded as it
    comes (a stage stopped at its limit keeps the first ones): ``exact_mismatch_max_bf16`` (goal 0.0),
    ``exact_decode_ratio`` with the tokens/s at batch 1 and 16, ``exact_train_ratio``, then
    ``exact_mismatch_max_fp32`` if the time left before ``deadline`` (``time.perf_counter``) holds twice
    what the bfloat16 one took (else None and ``exact_mismatch_fp32_why``). First ``exact_kernels``: what
    the model's ``"auto"`` exact kernels resolve to here (``models.exact_kernels.resolve``), hence ran."""
    from experiments import bench_engine, bench_exact
    from rstar2jax import models

    shape = bench_exact.SHAPE if smoke else models.preset("qwen3-1.7b")
    record(exact_model=f"{'tiny' if smoke else 'qwen3-1.7b'} bfloat16 compute, random weights",
           exact_kernels=models.exact_kernels.resolve(dataclasses.replace(shape, numerics="exact")))
    print(f"exact numerics compute with: {record.figures['exact_kernels']}", flush=True)
    # Smoke: the fewest tokens that run every program (no figure of a smoke run is a measurement).
    sizes = dict(prompts=2, new_tokens=8) if smoke else {}
    repeats, new_tokens, rows, steps = (1, 8, 2, 1) if smoke else (2, 64, 4, 3)
    start = time.perf_counter()
    record(exact_mismatch_max_bf16=bench_exact.logprob_mismatch("bfloat16", "exact", shape=shape, **sizes))
    bf16_s = time.perf_counter() - start
    print(f"max |engine - trainer| log-prob, exact numerics, bfloat16: "
          f"{record.figures['exact_mismatch_max_bf16']} ({bf16_s:.0f} s)", flush=True)
    rates = bench_exact.decode_ratios(bench_engine.generate_tokens_per_s, new_tokens=new_tokens,
                                      repeats=repeats, dtype="bfloat16", shape=shape)
    for batch, ratio in rates["ratio"].items():
        record(**{f"exact_decode_tokens_per_s_b{batch}": round(rates["exact"][batch], 1),
                  f"default_decode_tokens_per_s_b{batch}": round(rates["default"][batch], 1),
                  f"exact_decode_ratio_b{batch}": round(ratio, 3)})
        print(f"decode tok/s at batch {batch}: exact {rates['exact'][batch]:.1f}, default "
              f"{rates['default'][batch]:.1f}, ratio {ratio:.2f}", flush=True)
    record(exact_decode_ratio=round(min(rates["ratio"].values()), 3))
    train = bench_exact.train_rates(rows=rows, steps=steps, dtype="bfloat16", shape=shape)
    record(exact_train_ratio=round(train["exact"] / train["default"], 3),
           exact_train_tokens_per_s=round(train["exact"], 1),
           default_train_tokens_per_s=round(train["default"], 1))
    print(f"rl_step tok/s ({rows} x 128): exact {train['exact']:.1f}, default {train['default']:.1f}",
          flush=True)
    if deadline - time.perf_counter() < 2 * bf16_s:
        record(exact_mismatch_max_fp32=None, exact_mismatch_fp32_why="no time left in the stage's share")
    else:
        record(exact_mismatch_max_fp32=bench_exact.logprob_mismatch("float32", "exact", shape=shape, **sizes))
    print(f"max |engine - trainer| log-prob, exact numerics, float32: "
          f"{record.figures['exact_mismatch_max_fp32']}", flush=True)


def stage_training(record: Recorder, smoke: bool) -> None:
    import dataclasses as dc

    import jax

    from experiments import bench_train
    from rstar2jax import models

    device = jax.devices()[0]
    peak = bench_train.peak_bf16_flops(device.device_kind)
    base = models.preset("tiny" if smoke else "qwen3-1.7b", compute_dtype="bfloat16", remat_policy="full")
    choice = models.attention.auto_choice(base.head_dim, base.compute_dtype)
    record(training_model="tiny" if smoke else "qwen3-1.7b", training_attention=choice.implementation,
           peak_bf16_tflops=None if peak is None else peak / 1e12)
    shapes = {"8k": (2, 256) if smoke else (8, 8192), "2k": (4, 64) if smoke else (16, 2048)}
    steps = 1 if smoke else 2
    for attention, suffix in (("auto", ""), ("blockwise", "_blockwise")):
        if attention == "blockwise" and choice.implementation == "blockwise":
            # "auto" is the blockwise attention here: its figures are these.
            record(**{f"{key}_blockwise": value for key, value in record.figures.items()
                      if key.startswith(("mfu_", "rl_step_"))})
            break
        for label, (rows, seq_len) in shapes.items():
            config = dc.replace(base, attention=attention)
            batch = bench_train._packed_batch([seq_len + 1] * rows, seq_len, config.vocab_size, pack=False)
            timing = bench_train.rl_step_timing(config, batch, steps)
            tokens_per_s = rows * seq_len / timing["step_s"]
            flops = bench_train.rl_step_flops(config, rows, seq_len)
            mfu = None if peak is None else flops / timing["step_s"] / peak
            record(**{f"mfu_{label}{suffix}": None if mfu is None else round(mfu, 4),
                      f"rl_step_tokens_per_s_{label}{suffix}": round(tokens_per_s, 1),
                      f"rl_step_s_{label}{suffix}": round(timing["step_s"], 4),
                      f"rl_step_compile_s_{label}{suffix}": round(timing["compile_s"], 1)})
            name = choice.implementation if attention == "auto" else attention
            print(f"rl_step {rows} x {seq_len}, attention {name}: {timing['step_s']:.3f} s/step, "
                  f"{tokens_per_s:.0f} tokens/s, MFU {'n/a' if mfu is None else f'{mfu:.1%}'}, compile "
                  f"{timing['compile_s']:.0f} s", flush=True)
    record(attention_tflops=_attention_kernels(base, smoke))


def _attention_kernels(config, smoke: bool) -> dict:
    """TFLOP/s of each training attention that can run here, forward and backward of a batch of 8 rows of
    8,192 tokens of ``config`` (causal FLOPs: 7 x T^2 x heads x head_dim per row, FlashAttention's count of
    forward + backward), best of 5 after a warm-up."""
    import jax
    import numpy as np

    from rstar2jax.models import attention, attention_kernels
    from rstar2jax.models.platform import accelerator

    rows, length = (2, 256) if smoke else (8, 8192)
    rng = np.random.default_rng(0)
    q = rng.normal(size=(rows, length, config.num_heads, config.head_dim)) * config.head_dim**-0.5
    k, v = (rng.normal(size=(rows, length, config.num_kv_heads, config.head_dim)) for _ in range(2))
    q, k, v = (jax.numpy.asarray(x, config.compute_dtype) for x in (q, k, v))
    segments = np.ones((rows, length), np.int32)
    flops = 7 * rows * length**2 * config.num_heads * config.head_dim
    gpu = jax.default_backend() != "cpu"
    kernels = ["blockwise", *(n for n in attention.AUTO_CANDIDATES.get(accelerator(), ())
                              if gpu and attention_kernels.unavailable_reason(n, config.head_dim) is None)]
    results = {}
    for name in kernels:
        loss = lambda q, k, v, name=name: attention.attention(q, k, v, segments, implementation=name).astype(
            jax.numpy.float32).sum()
        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        try:
            jax.block_until_ready(grad(q, k, v))
            best = float("inf")
            for _ in range(5):
                start = time.perf_counter()
                jax.block_until_ready(grad(q, k, v))
                best = min(best, time.perf_counter() - start)
        except Exception as error:  # noqa: BLE001 (a kernel that does not run here is reported, not fatal)
            results[name] = f"{type(error).__name__}: {str(error)[:200]}"
            continue
        results[name] = round(flops / best / 1e12, 2)
        print(f"attention {name}, forward + backward, {rows} x {length}: {results[name]} TFLOP/s", flush=True)
    return results


def stage_loop(record: Recorder, smoke: bool) -> None:
    _require("ml_collections")
    from experiments.configs import qwen3_1p7b_1gpu
    from experiments.train_rl import agent_rollout_fn
    from rstar2jax import train
    from rstar2jax.eval import EVAL_SETS_DIR
    from rstar2jax.train.metrics import METRICS_FILE
    from rstar2jax.train.runtime import mesh_size

    # The run's folder is temporary: its final checkpoint (the 1.7B model's weights and AdamW moments, ~20 GB)
    # is not a result, and two fresh steps never resume from an earlier one.
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="accelerator_check_loop_"))
    config = loop_config(qwen3_1p7b_1gpu.get_config(), workdir, smoke, str(EVAL_SETS_DIR / "aime24.jsonl"))
    options = train.parse(config, "rl")
    train.prepare_process(options)
    compiles = CompileEvents()
    steps_seen = []

    def on_step(step_record: dict) -> None:
        """Figures after every step, so a stage stopped in the final checkpoint save keeps them."""
        steps_seen.append((step_record, time.perf_counter()))
        record(**loop_figures(steps_seen, compiles, mesh_size(options)))

    stop_watching = threading.Event()
    watcher = threading.Thread(target=_follow_metrics, args=(options.workdir / METRICS_FILE,
                                                             on_step, stop_watching), daemon=True)
    record(loop_config=f"{config.rl.prompts_per_step} prompts x {config.rl.samples_per_problem} samples, "
                       f"{config.stages[0].max_response_length}-token responses, model {config.model.preset}")
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, workdir, ignore_errors=True)
        watcher.start()
        history = train.train_rl(options, rollout_fn=agent_rollout_fn(options, stack), max_steps=2)
        stop_watching.set()
        watcher.join(timeout=5)
    if len(steps_seen) < len(history):  # the watcher's last look came before the last step's line
        for step_record in history[len(steps_seen):]:
            on_step(step_record)


def loop_config(config, workdir: pathlib.Path, smoke: bool, problems: str):
    """``qwen3_1p7b_1gpu.py`` cut to two short steps: 4 prompts x its 16 samples (RoC keeps its 8),
    1,024-token responses, the bundled AIME 2024 problems, no TensorBoard. Random weights score 0 on every
    rollout, which would drop every group (``rl.reject_equal_reward``) and leave the update nothing to train
    on: groups are kept, so the update runs on the step's real batch. Under ``smoke`` the tiny model with
    the Qwen3 vocabulary, 2 prompts x 2 samples of 16 tokens, the optimizer where the backend puts it."""
    config.workdir = str(workdir)
    config.data.source = problems
    config.logging.tensorboard = False
    config.logging.progress_every = 1
    config.rl.prompts_per_step = 4
    config.rl.reject_equal_reward = False
    config.num_microbatches = 4  # the 32 kept trajectories pack into ~16 rows of 3,072 tokens
    config.stages[0].steps = 2
    config.stages[0].max_response_length = 1024
    config.checkpoint.save_every = 1000
    if smoke:
        config.model.preset = "tiny"
        config.model.spec.vocab_size = 151936  # the Qwen3 tokenizer's ids
        config.rl.prompts_per_step, config.rl.samples_per_problem, config.rl.keep = 2, 2, 2
        config.batch.max_prompt_length = 768
        config.stages[0].max_response_length = 16
        config.stages[0].max_turns = 1
        config.rollout.engine_slots = 4
        config.rollout.kv_cache_tokens = 0
        config.colocate.optimizer_memory = "auto"
        config.device_memory_gib = None
        config.num_microbatches = 1
    return config


class CompileEvents:
    """Seconds JAX spends lowering and compiling (its monitoring events), each with the time it ended."""

    EVENTS = ("/jax/core/compile/jaxpr_to_mlir_module_duration", "/jax/core/compile/backend_compile_duration")

    def __init__(self):
        import jax

        self.events: list[tuple[float, float]] = []
        jax.monitoring.register_event_duration_secs_listener(self._listen)

    def _listen(self, event: str, duration: float, **kwargs) -> None:
        if event in self.EVENTS:
            self.events.append((time.perf_counter(), duration))

    def seconds_between(self, start: float, end: float) -> float:
        return sum(duration for ended, duration in self.events if start <= ended <= end)


def loop_figures(steps_seen: list[tuple[dict, float]], compiles: CompileEvents, devices: int) -> dict:
    """Per step (its metrics and when they were seen): step, rollout and update seconds and compile seconds
    inside the step; generated tokens/s per device over the steps so far with compile time taken out."""
    figures, generated, busy, compile_total = {}, 0.0, 0.0, 0.0
    for index, (metrics, seen) in enumerate(steps_seen, start=1):
        step_s = metrics["time/step"]
        compile_s = compiles.seconds_between(seen - step_s, seen)
        tokens = metrics["throughput/rollout_tokens_per_s"] * metrics["time/rollout"]
        figures.update({
            f"loop_step{index}_s": round(step_s, 2),
            f"loop_step{index}_compile_s": round(compile_s, 2),
            f"loop_step{index}_rollout_s": round(metrics["time/rollout"], 2),
            f"loop_step{index}_update_s": round(metrics["time/update"], 2),
            f"loop_step{index}_generated_tokens": int(round(tokens)),
        })
        generated += tokens
        busy += step_s - compile_s
        compile_total += compile_s
    figures.update(
        loop_steps=len(steps_seen),
        loop_compile_s=round(compile_total, 2),
        rl_step_generated_tokens_per_s_per_gpu=round(generated / max(busy, 1e-9) / devices, 1),
        nemo_rl_generated_tokens_per_s_per_gpu=NEMO_RL_TOKENS_PER_S_PER_GPU,
    )
    return figures


def _follow_metrics(path: pathlib.Path, on_step: Callable[[dict], None], stop: threading.Event) -> None:
    """Calls ``on_step`` with each new line of a run's ``metrics.jsonl`` as it is written."""
    done = 0
    while not stop.wait(0.25):
        if not path.exists():
            continue
        text = path.read_text(encoding="utf-8")
        complete = text.splitlines() if text.endswith("\n") else text.splitlines()[:-1]
        for line in complete[done:]:
            on_step(json.loads(line))
        done = max(done, len(complete))


STAGE_FUNCTIONS = {"environment": stage_environment, "tests": stage_tests, "engine": stage_engine,
                   "training": stage_training, "exact": stage_exact, "loop": stage_loop}


def run_stage(name: str) -> None:
    """One stage in this process: its figures go to ``stage_<name>.json`` as they come; a failure is recorded
    there too (``error``) and exits non-zero."""
    output = pathlib.Path(_OUTPUT_DIR.value)
    record = Recorder(output / f"stage_{name}.json")
    logging.set_verbosity(logging.WARNING)  # JAX's backend search and orbax's checkpoint notes
    # Stopped at its time limit (SIGTERM to its group): unwind, so that what it started (a sandbox, the
    # loop's temporary run folder) is cleaned up.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        STAGE_FUNCTIONS[name](record, _SMOKE.value)
    except MissingModule as error:
        record(error=str(error))
        print(f"{name}: {error}", file=sys.stderr, flush=True)
        sys.exit(3)
    except Exception as error:
        record(error=f"{type(error).__name__}: {' '.join(str(error).split())[:500]}")
        raise


# ---- the run: stages one after the other, each in its own process


def stage_environ(smoke: bool) -> dict:
    """The environment every stage process runs in: the checkout first on the path (so it runs without
    installing), the parent's JAX settings otherwise; under ``smoke`` XLA's backend optimisation and CPU
    fusion emitters are off (tiny programs compile several times faster, and no figure of a smoke run is a
    measurement)."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}  # each line as it is printed
    if smoke:
        env["XLA_FLAGS"] = (f"{env.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0"
                            " --xla_cpu_use_fusion_emitters=false").strip()
    return env


def stage_limits(budget_left: float, remaining: list[Stage]) -> float:
    """Seconds the first of ``remaining`` gets: its share of the time left against the stages still to run."""
    total = sum(s.share for s in remaining)
    return budget_left * remaining[0].share / total


def main(argv) -> None:
    del argv
    if _STAGE.value:
        run_stage(_STAGE.value)
        return
    unknown = [s for s in _STAGES.value if s not in STAGE_NAMES]
    budget = _BUDGET_S.value if _BUDGET_S.value is not None else (SMOKE_BUDGET_S if _SMOKE.value else 540.0)
    if unknown or budget <= 0:
        print(f"error: {'--stages: unknown ' + ', '.join(unknown) if unknown else '--budget_s must be > 0'}"
              f" (stages: {', '.join(STAGE_NAMES)})", file=sys.stderr)
        sys.exit(2)
    # SIGTERM (a scheduler's or a tool's time limit) ends the run like Ctrl-C: the running stage's processes
    # are stopped and what it recorded is kept.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    output = pathlib.Path(_OUTPUT_DIR.value).resolve()
    output.mkdir(parents=True, exist_ok=True)
    selected = [s for s in STAGES if s.name in _STAGES.value]
    result = {"device": None, "smoke": _SMOKE.value, "budget_s": budget, "stages": {}}
    start = time.perf_counter()
    names = ", ".join(s.name for s in selected)
    print(f"accelerator check{' (smoke)' if _SMOKE.value else ''}: stages {names}, {budget:.0f} s in all; "
          f"results in {output / RESULT_FILE}", flush=True)
    interrupted = False
    for index, stage in enumerate(selected):
        left = budget - (time.perf_counter() - start)
        limit = (min(stage.smoke_s * budget / SMOKE_BUDGET_S, left) if _SMOKE.value
                 else stage_limits(left, selected[index:]))
        try:
            result["stages"][stage.name] = run_one(stage, limit, output)
        except KeyboardInterrupt:
            interrupted = True
            result["stages"][stage.name] = {"status": "interrupted", "seconds": None,
                                            "limit_s": round(limit, 1)}
        path = output / f"stage_{stage.name}.json"
        figures = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
        figures.pop("error", None)  # in the stage's status
        result.update(figures)
        _write_json(output / RESULT_FILE, result)
        if interrupted:
            break
    result["seconds"] = round(time.perf_counter() - start, 1)
    if _SMOKE.value:
        statuses = [result["stages"].get(name, {}).get("status") for name in STAGE_NAMES]
        result["smoke_ok"] = statuses == ["ok"] * len(STAGE_NAMES)
    _write_json(output / RESULT_FILE, result)
    print_table(result)
    print(json.dumps(result, default=str), flush=True)
    if interrupted:
        sys.exit(130)


def run_one(stage: Stage, limit: float, output: pathlib.Path) -> dict:
    """Runs one stage process under ``limit`` seconds; its status, seconds, limit and error (if any)."""
    (output / f"stage_{stage.name}.json").unlink(missing_ok=True)
    print(f"\n== {stage.name}: {stage.description} (limit {limit:.0f} s)", flush=True)
    if limit < 5:
        return {"status": "skipped: no time left", "seconds": 0.0, "limit_s": round(limit, 1)}
    command = [sys.executable, "-m", "experiments.accelerator_check", f"--stage={stage.name}",
               f"--output_dir={output}", f"--smoke={_SMOKE.value}", f"--stage_limit_s={limit}"]
    tail = collections.deque(maxlen=20)
    began = time.perf_counter()
    returncode = _run_streaming(command, env=stage_environ(_SMOKE.value), timeout=limit, on_line=tail.append,
                                prefix=f"[{stage.name}] ")
    seconds = round(time.perf_counter() - began, 1)
    path = output / f"stage_{stage.name}.json"
    error = json.loads(path.read_text(encoding="utf-8")).get("error") if path.exists() else None
    if returncode is None:
        status = f"timed out after {limit:.0f} s"
    elif returncode == 0:
        status = "ok"
    else:
        last = next((line.strip() for line in reversed(tail) if line.strip()), f"exit status {returncode}")
        status = f"failed: {error or last}"
    return {"status": status, "seconds": seconds, "limit_s": round(limit, 1)}


# Figures of the table: (key, what, goal).
TABLE = (
    ("device", "device", ""),
    ("jax", "JAX", ""),
    ("training_attention", "training attention 'auto'", ""),
    ("paged_attention_auto", "paged decode attention 'auto'", ""),
    ("missing_modules", "missing modules", ""),
    ("gpu_tests_failed", "accelerator tests failed", "0"),
    ("gpu_tests_passed", "accelerator tests passed", ""),
    ("mfu_8k", "MFU, rl_step 8 x 8,192, auto attention", ">= 0.35 (H100)"),
    ("mfu_2k", "MFU, rl_step 16 x 2,048, auto attention", ">= 0.40 (H100)"),
    ("mfu_8k_blockwise", "MFU, rl_step 8 x 8,192, blockwise", ""),
    ("mfu_2k_blockwise", "MFU, rl_step 16 x 2,048, blockwise", ""),
    ("rl_step_tokens_per_s_8k", "rl_step tokens/s, 8 x 8,192", ""),
    ("rl_step_tokens_per_s_2k", "rl_step tokens/s, 16 x 2,048", ""),
    ("attention_tflops", "attention fwd+bwd TFLOP/s", ""),
    ("engine_ready_s", "time to a ready engine, s", ""),
    ("decode_step_over_floor_b1", "decode step over floor, batch 1", "<= 1.5"),
    ("decode_step_over_floor_b64", "decode step over floor, batch 64", "<= 1.5"),
    ("kv_bytes_ratio", "KV bytes held / tokens' KV", "<= 1.25"),
    ("group_prompt_kv_ratio", "KV of a prompt x 16 samples / tokens'", "<= 1.2"),
    ("fp8_decode_speedup", "decode tok/s FP8 / bf16, 64 x 512 held", ">= 1.2"),
    ("exact_mismatch_max_bf16", "exact: max |engine - trainer| logp, bf16", "0.0"),
    ("exact_mismatch_max_fp32", "exact: max |engine - trainer| logp, fp32", "0.0"),
    ("exact_decode_ratio", "exact: decode tok/s / default, min b1/b16", ">= 0.9"),
    ("exact_train_ratio", "exact: rl_step tok/s / default", ">= 0.9"),
    ("loop_compile_s", "loop: compile s (two steps)", ""),
    ("loop_step2_s", "loop: second step s", ""),
    ("rl_step_generated_tokens_per_s_per_gpu", "loop: generated tokens/s/GPU", "NeMo-RL 8B: 1,562"),
)


def print_table(result: dict) -> None:
    print(f"\n{'stage':<12}{'status':<50}{'seconds':>9}{'limit':>8}")
    for name, stage in result["stages"].items():
        seconds = "-" if stage["seconds"] is None else f"{stage['seconds']:.1f}"
        print(f"{name:<12}{stage['status'][:49]:<50}{seconds:>9}{stage['limit_s']:>8.0f}")
    print(f"\n{'figure':<42}{'value':<44}goal")
    for key, what, goal in TABLE:
        value = result.get(key)
        shown = json.dumps(value) if isinstance(value, dict | list) else str(value)
        shown = "-" if value is None else shown
        print(f"{what:<42}{shown[:43]:<44}{goal}")
    failures = result.get("gpu_tests_failures") or {}
    for name, why in list(failures.items())[:20]:
        print(f"  failed: {name}: {why}")


if __name__ == "__main__":
    app.run(main)
