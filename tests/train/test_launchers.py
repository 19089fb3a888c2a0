"""The absl launchers: --help, config errors before compute, the 14B paper config's dry run on 64 emulated
CPU devices, and an SFT run that resumes."""

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from rstar2jax.data.conversation import PromptConfig, load_prompt_config
from tests.conftest import REPO_ROOT
from tests.train.bad_options import BACKEND_REFUSALS, CONTRADICTIONS, bad_values, override


def _launch(module, *args, env=None, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_help_and_config_errors():
    done = _launch("experiments.train_rl", "--help")  # absl's usage exit code is 1
    for flag in (
        "--config",
        "--[no]dry_run",
        "--max_steps",
        "--[no]print_config",
        "--config.stages[0].steps",
    ):
        assert flag in done.stdout, flag
    done = _launch(
        "experiments.train_rl",
        "--config=experiments/configs/paper_qwen3_14b.py",
        "--print_config",
        "--config.stages[2].steps=7",
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "stages[2].steps = 7 " in done.stdout and "loss.eps_high = 0.28 " in done.stdout
    assert all(" # " in line and "(no description)" not in line for line in lines), lines
    assert any(line.startswith("data.integer_only = True ") for line in lines)

    # A bad config value or override: exit 2, one line naming the field, the value and what is allowed.
    for module, args, line in [
        (
            "experiments.train_rl",
            ["--config.rl.keep=40", "--dry_run"],
            "error: config.rl.keep=40: must be an integer in [1, rl.samples_per_problem=4]",
        ),
        (
            "experiments.sft",
            [":sft", "--config.sft.data=missing.jsonl"],
            "error: config.sft.data='missing.jsonl': does not exist",
        ),
        (
            "experiments.train_rl",
            ["--config.rl.kep=1"],
            'error: --config.rl.kep=1: no config field \'kep\'; Did you mean "keep" instead of "kep"?',
        ),
        (
            "experiments.train_rl",
            ["--config.rl.keep=two"],
            "error: flag --config.rl.keep=two: invalid literal",
        ),
        (  # a check of the engine's sampling, once a traceback and exit 1
            "experiments.train_rl",
            ["--config.rollout.temperature=-1"],
            "error: config.rollout.temperature=-1.0: must be positive",
        ),
        (  # the loss reads the rollout's temperature: the field moved
            "experiments.train_rl",
            ["--config.loss.temperature=0.6"],
            "error: --config.loss.temperature=0.6: no config field 'temperature'; use rollout.temperature",
        ),
    ]:
        config = "--config=experiments/configs/tiny_cpu.py" + (args.pop(0) if args[0] == ":sft" else "")
        done = _launch(module, config, *args)
        assert done.returncode == 2 and done.stderr.startswith(line), (args, done.stderr[-2000:])
        assert done.stderr.count("\n") == 1, done.stderr


def test_a_mesh_larger_than_the_devices_exits_2_before_writing(tmp_path):
    """config.mesh needs data x fsdp x tensor devices: with fewer (here one CPU device, the backend started
    before the launcher could emulate more, as on a one-GPU host) the launcher exits 2 with one line and
    writes nothing, not a traceback after the work folder exists."""
    workdir = tmp_path / "run"
    code = (
        "import runpy, sys, jax\n"
        "jax.devices()  # the backend starts with one CPU device: too late to emulate three\n"
        "sys.argv = ['train_rl', '--config=experiments/configs/tiny_cpu.py', '--config.mesh.fsdp=3',\n"
        f"            '--config.workdir={workdir}']\n"
        "runpy.run_module('experiments.train_rl', run_name='__main__')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.startswith("error: config.mesh: data x fsdp x tensor = 1 x 3 x 1 needs 3 devices but "
                                  "1 cpu devices are left for training"), done.stderr
    assert done.stderr.count("\n") == 1 and not workdir.exists()


@pytest.mark.slow  # 25 s on 2 cores; the paper config's parse and memory plan: tests/train/test_config.py
def test_paper_config_dry_runs_on_64_emulated_devices(compile_cache_env):
    env = {k: v for k, v in compile_cache_env.items() if k != "XLA_FLAGS"}  # the launcher must ask for 64
    done = _launch(
        "experiments.train_rl", "--config=experiments/configs/paper_qwen3_14b.py", "--dry_run", env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "compiled for 64 cpu devices, mesh {'data': 1, 'fsdp': 8, 'tensor': 8}" in done.stdout
    assert "14,768.3M parameters" in done.stdout and "batch [8192, 14335]" in done.stdout
    # The memory-efficient path: blockwise attention on CPU devices, log-probs by vocabulary chunks.
    assert "attention blockwise, remat full, log-probs by vocabulary chunks" in done.stdout
    peak = float(done.stdout.split("peak_estimate")[1].split()[0])
    assert 3 < peak < 80, peak  # GiB per device: sharded weights + AdamW + one row's activations


@pytest.mark.slow  # a launcher run and its resume, 24-38 s on 2 cores
def test_sft_launcher_trains_and_resumes(tmp_path, compile_cache_env):
    rng = np.random.default_rng(0)
    data = tmp_path / "sft.jsonl"
    with data.open("w") as f:
        for _ in range(24):
            n = int(rng.integers(8, 40))
            ids = (rng.integers(0, 64, n) * 2).tolist()  # a learnable pattern: even tokens only
            f.write(json.dumps({"input_ids": ids, "loss_mask": [0] * 3 + [1] * (n - 3)}) + "\n")
        f.write(json.dumps({"input_ids": [1, 2, 3], "loss_mask": [0, 0, 0]}) + "\n")  # nothing to train on
    args = [
        "--config=experiments/configs/tiny_cpu.py:sft",
        f"--config.sft.data={data}",
        f"--config.workdir={tmp_path / 'run'}",
        "--config.tokenizer=",
        "--config.model.spec.vocab_size=128",
        "--config.model.scan_layers=False",
        "--config.sft.epochs=3",
        "--config.sft.seq_len=128",
        "--config.sft.warmup_fraction=0.25",
        "--config.optimizer.learning_rate=0.01",
        "--config.checkpoint.save_every=2",
        "--config.logging.progress_every=3",
    ]
    first = _launch("experiments.sft", *args, "--max_steps=4", env=compile_cache_env)
    assert first.returncode == 0, first.stderr[-3000:]
    run = (tmp_path / "run").resolve()
    banner = (
        f"sft: work folder {run}\n  checkpoints: {run / 'checkpoints'}\n"
        f"  metrics:     {run / 'metrics.jsonl'}\n  tensorboard --logdir {run / 'tensorboard'}"
    )
    assert first.stdout.startswith(banner), first.stdout
    # Not a terminal: one short line every 3 steps and at the last, no progress bar.
    progress = [line for line in first.stdout.splitlines() if line.startswith("sft step")]
    assert [line.split(":")[0] for line in progress] == [
        "sft step 3/4 (epoch 1.00)",
        "sft step 4/4 (epoch 1.33)",
    ]
    assert all(len(line) < 100 and "loss" in line for line in progress) and "\r" not in first.stdout
    assert "resuming" not in first.stdout
    second = _launch("experiments.sft", *args, env=compile_cache_env)
    assert second.returncode == 0, second.stderr[-3000:]
    resumed = f"resuming SFT from the checkpoint at step 4 of 9 in {run / 'checkpoints'} (epoch 1.33)\n"
    assert resumed in second.stdout, second.stdout
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 10))  # 3 epochs x ceil(24 / 8) steps
    assert records[0]["examples_skipped"] == 1 and records[-1]["epoch"] == 3.0
    # ln(128) at the start; ln(64) once the model puts its mass on the even tokens
    assert records[0]["loss"] > 4.6 and records[-1]["loss"] < 4.4, [r["loss"] for r in records]
    lr = [r["learning_rate"] for r in records]  # 3 warm-up steps (25% of 9), then cosine decay to 0
    np.testing.assert_allclose(lr[:3], [0.01 / 3, 0.02 / 3, 0.01], rtol=1e-5)
    assert lr[3] == lr[2] and all(a > b for a, b in zip(lr[3:], lr[4:], strict=False)) and lr[-1] < 0.001
    # The exported policy records the config's conversation format (pre-tokenised data name no opener).
    assert load_prompt_config(run / "policy") == PromptConfig()
    assert f"compilation cache: {compile_cache_env['JAX_COMPILATION_CACHE_DIR']} " in first.stdout


@pytest.mark.slow  # a launcher run stopped and resumed, 10-22 s on 2 cores
def test_ctrl_c_saves_a_checkpoint_and_exits_with_one_line(tmp_path, compile_cache_env):
    data = tmp_path / "sft.jsonl"
    data.write_text(
        "".join(json.dumps({"input_ids": list(range(2, 20)), "loss_mask": [1] * 18}) + "\n" for _ in range(8))
    )
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "experiments.sft",
            "--config=experiments/configs/tiny_cpu.py:sft",
            f"--config.sft.data={data}",
            f"--config.workdir={tmp_path / 'run'}",
            "--config.tokenizer=",
            "--config.model.spec.vocab_size=32",
            "--config.model.scan_layers=False",
            "--config.sft.steps=100000",
            "--config.sft.seq_len=32",
            "--config.checkpoint.save_every=1000",
            "--config.logging.progress_every=2",
        ],
        cwd=REPO_ROOT,
        env=compile_cache_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for line in process.stdout:
            if line.startswith("sft step 2/"):
                process.send_signal(signal.SIGINT)
                break
        stdout, stderr = process.communicate(timeout=300)
    finally:
        process.kill()
    checkpoints = (tmp_path / "run" / "checkpoints").resolve()
    saved = max(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit())
    assert process.returncode == 130, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == (
        f"interrupted: checkpoint of step {saved} saved in {checkpoints}; run the same command to resume"
    ), stderr
    assert "Traceback" not in stderr and 2 <= saved < 100000


def test_compilation_cache_folder_defaults_and_switch(monkeypatch, tmp_path):
    """Default: $JAX_COMPILATION_CACHE_DIR, else $XDG_CACHE_HOME/rstar2jax/jax, else ~/.cache/rstar2jax/jax;
    enabling lifts the thresholds that keep small (CPU) programs out, unless the environment sets them; ''
    turns the cache off. JAX's settings are restored afterwards (nothing compiles in between)."""
    import jax

    from experiments import _launch

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for name in ("JAX_COMPILATION_CACHE_DIR", "XDG_CACHE_HOME", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"):
        monkeypatch.delenv(name, raising=False)
    assert _launch.default_compilation_cache_dir() == str(tmp_path / "home" / ".cache" / "rstar2jax" / "jax")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert _launch.default_compilation_cache_dir() == str(tmp_path / "xdg" / "rstar2jax" / "jax")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax"))
    assert _launch.default_compilation_cache_dir() == str(tmp_path / "jax")

    names = (
        "jax_compilation_cache_dir",
        "jax_enable_compilation_cache",
        "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes",
    )
    saved = {name: jax.config.values[name] for name in names}
    try:
        assert _launch.enable_compilation_cache(str(tmp_path / "c")) == str(tmp_path / "c")
        assert jax.config.values["jax_compilation_cache_dir"] == str(tmp_path / "c")
        assert jax.config.values["jax_enable_compilation_cache"] is True
        assert jax.config.values["jax_persistent_cache_min_compile_time_secs"] == 0
        assert jax.config.values["jax_persistent_cache_min_entry_size_bytes"] == -1
        assert _launch.compilation_cache_line().startswith(f"compilation cache: {tmp_path / 'c'} ")
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 2.0)
        monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "2")
        _launch.enable_compilation_cache(str(tmp_path / "c"))
        assert jax.config.values["jax_persistent_cache_min_compile_time_secs"] == 2.0  # the user's
        assert _launch.enable_compilation_cache("") is None
        assert jax.config.values["jax_enable_compilation_cache"] is False
        assert _launch.compilation_cache_line() == "compilation cache: off"
    finally:
        for name, value in saved.items():
            jax.config.update(name, value)


_ONE_START = """
import sys

import jax

from experiments import _launch

_launch.enable_compilation_cache(sys.argv[1])
clock = _launch.StartupClock()
clock.watch_programs()
from rstar2jax import models
from rstar2jax.engine import EngineConfig, generate

config = models.preset("tiny")
params = models.init_params(config, jax.random.key(0))
engine_config = EngineConfig(num_slots=2, max_len=64, token_buckets=(2, 16))
for temperature in (0.0, 0.8):  # the greedy-only program, then the general one
    generate(params, config, [[5, 6, 7], [8, 9]], max_new_tokens=5, temperature=temperature, top_k=4,
             engine_config=engine_config)
print(clock.programs_line())
"""


@pytest.mark.slow  # two process starts, 23 s on 2 cores
def test_a_second_process_compiles_nothing(tmp_path):
    """With a launcher's compilation cache (JAX's thresholds left as the launcher sets them), a second process
    doing the same work loads every program the first compiled (the engine's step programs, the small ones
    too) and compiles none."""
    import os
    import re

    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_PERSISTENT_CACHE_MIN_")}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO_ROOT))
    counts = []
    for _ in range(2):
        result = subprocess.run([sys.executable, "-c", _ONE_START, str(tmp_path / "cache")], cwd=REPO_ROOT,
                                env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        line = re.search(r"^(\d+) XLA programs loaded from the compilation cache, (\d+) compiled$",
                         result.stdout, re.M)
        assert line, result.stdout
        counts.append((int(line[1]), int(line[2])))
    (first_loaded, first_compiled), (second_loaded, second_compiled) = counts
    assert first_loaded == 0 and first_compiled >= 3  # the state builder and both step programs at least
    assert (second_loaded, second_compiled) == (first_compiled, 0)


def test_two_launches_in_one_process_share_no_stop_state(tmp_path):
    """Two SFT launches in one process, each as ``experiments.sft`` runs its loop (``console_logging``,
    ``stop_on_signals``): a Ctrl-C in the first stops only the first (checkpoint, ``Interrupted``); the
    second runs to its end, and the signal handlers are the ones from before each launch."""
    import os
    import threading
    import time

    from experiments import _launch
    from experiments.configs import tiny_cpu
    from rstar2jax import train

    data = tmp_path / "sft.jsonl"
    data.write_text(
        "".join(json.dumps({"input_ids": list(range(2, 20)), "loss_mask": [1] * 18}) + "\n" for _ in range(8))
    )

    def config(name, steps):
        c = tiny_cpu.get_config("sft")
        c.sft.data, c.workdir, c.tokenizer = str(data), str(tmp_path / name), ""
        c.model.spec.vocab_size, c.model.scan_layers = 32, False
        c.sft.steps, c.sft.seq_len, c.checkpoint.save_every = steps, 32, 1000
        c.logging.progress = False
        return train.parse(c)  # what experiments.sft trains: the config's options

    def interrupt_after_first_step(metrics):
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not (metrics.exists() and metrics.read_text().strip()):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)

    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    first = config("first", 100000)
    with _launch.console_logging(), _launch.stop_on_signals() as stop:
        threading.Thread(
            target=interrupt_after_first_step, args=(tmp_path / "first" / "metrics.jsonl",), daemon=True
        ).start()
        with pytest.raises(train.Interrupted) as stopped:
            train.train_sft(first, stop=stop)
    assert 1 <= stopped.value.step < 100000
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    assert not stop.request()  # the first launch's stop is spent: nothing holds it any more

    with _launch.console_logging(), _launch.stop_on_signals() as stop:
        history = train.train_sft(config("second", 3), stop=stop)
    assert [record["step"] for record in history] == [1, 2, 3]
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


@pytest.mark.parametrize(
    "launcher, config_file, kind",
    [("experiments.train_rl", "experiments/configs/tiny_cpu.py", "rl"),
     ("experiments.sft", "experiments/configs/tiny_cpu.py:sft", "sft")],
)
def test_every_bad_option_gets_one_line(launcher, config_file, kind, tmp_path):
    """Every scalar field of the config (walked from the config itself, ``bad_options.bad_values``) set to
    each bad value its check declares, the values that contradict another field, and (RL) a rollout precision
    the backend cannot run, each given to the launcher on its command line: exit 2, one line ``error: ...``
    naming the field, no traceback, nothing written to the work folder. The launcher runs as ``python -m``
    runs it, in a process forked per case
    (``tests/train/bad_options.py``) so the cases share one start of the interpreter."""
    from experiments.configs import tiny_cpu

    fields = bad_values(tiny_cpu.get_config(kind), kind)
    cases = [[override(path, value)] for path, value in fields]
    cases += [[override(path, value) for path, value in o.items()] for k, o, _ in CONTRADICTIONS if k == kind]
    expected = [f"config.{path}" for path, _ in fields] + [m for k, _, m in CONTRADICTIONS if k == kind]
    if kind == "rl":
        cases += [{"args": [override(p, v) for p, v in o.items()], "refuse": probe}
                  for o, probe, _ in BACKEND_REFUSALS]
        expected += [m for _, _, m in BACKEND_REFUSALS]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    done = _launch("tests.train.bad_options", launcher, config_file, str(tmp_path / "cases.json"),
                   str(tmp_path / "runs"))
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.splitlines()[-1])
    for result, named in zip(results, expected, strict=True):
        lines = result["stderr"].splitlines()
        assert result["status"] == 2 and len(lines) == 1 and lines[0].startswith("error: "), result
        assert named in lines[0] and "Traceback" not in result["stderr"] and not result["wrote"], result
