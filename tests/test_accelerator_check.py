"""experiments.accelerator_check: its smoke run (every stage at tiny shapes on the CPU) and the pieces a GPU
run relies on when things go wrong (a stage past its time, a missing module, pytest's report)."""

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from experiments import accelerator_check as check
from rstar2jax.models import platform
from tests.conftest import REPO_ROOT

# What the GPU image of this workplace lacks among the library's dependencies (its package list).
ABSENT_ON_THE_GPU_IMAGE = ("ml_collections", "math_verify", "datasets", "tensorboardX", "tokamax")


def _python(code: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow  # every stage in its own process: 3-4 minutes on 2 cores; the pieces are tested below
def test_smoke_run_passes_every_stage_and_reports_the_contract_keys(tmp_path):
    """The budget is generous so that a loaded test machine cannot fail it; the script's own smoke default is
    120 s."""
    # As a user runs it: without the emulated CPU devices the test session asks for.
    xla_flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
    done = subprocess.run(
        [sys.executable, "-m", "experiments.accelerator_check", "--smoke", f"--output_dir={tmp_path}",
         "--budget_s=900"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=1200,
        env={**os.environ, "XLA_FLAGS": xla_flags},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == json.loads((tmp_path / check.RESULT_FILE).read_text())
    assert {name: stage["status"] for name, stage in result["stages"].items()} == dict.fromkeys(
        check.STAGE_NAMES, "ok")
    assert result["smoke_ok"] is True
    assert result["device"] == "cpu (cpu, 1 device)" and result["jax_supported"] is True
    assert result["training_attention"] == "blockwise"  # no GPU: nothing to probe
    assert result["gpu_tests_failed"] == 0 and result["gpu_tests_passed"] == 1
    for key in ("mfu_8k", "mfu_2k", "mfu_8k_blockwise", "mfu_2k_blockwise"):
        assert key in result and result[key] is None  # no bf16 peak for a CPU
    for key in ("rl_step_tokens_per_s_8k", "rl_step_tokens_per_s_2k", "decode_step_over_floor_b1",
                "decode_step_over_floor_b64", "engine_ready_s", "rl_step_generated_tokens_per_s_per_gpu"):
        assert result[key] > 0, key
    assert result["kv_bytes_ratio"] >= 1.0 and result["group_prompt_kv_ratio"] >= 1.0
    # This CPU has float8 but converts it to float32 for a matmul: no FP8 fast path to measure.
    assert result["fp8_decode_speedup"] is None and "no native FP8 matmul" in result["fp8_decode_why"]
    assert result["loop_steps"] == 2 and result["loop_step1_generated_tokens"] == 2 * 2 * 16
    assert result["nemo_rl_generated_tokens_per_s_per_gpu"] == 1562


def test_a_stage_that_needs_a_missing_module_fails_naming_it(tmp_path):
    """The loop stage needs ml_collections (the configs), which the GPU image lacks."""
    done = _python(
        """
        import runpy, sys
        sys.modules["ml_collections"] = None  # as if not installed
        sys.argv = ["accelerator_check", "--stage=loop", "--smoke", f"--output_dir={sys.argv[1]}"]
        runpy.run_module("experiments.accelerator_check", run_name="__main__")
        """,
        str(tmp_path),
    )
    assert done.returncode == 3, done.stderr[-2000:]
    recorded = json.loads((tmp_path / "stage_loop.json").read_text())
    assert recorded == {"error": "missing module ml_collections"}


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in pathlib.Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text in (entry / "cmdline").read_text().replace("\0", " "):
                found.append(int(entry.name))
        except OSError:  # gone meanwhile
            continue
    return found


def test_a_terminated_run_stops_its_stage_and_keeps_the_finished_ones(tmp_path):
    """SIGTERM (a tool's time limit) in the middle of a stage: the stage's processes go, the finished stage's
    figures stay in the JSON file and the last line, the interrupted stage is named."""
    run = subprocess.Popen(
        [sys.executable, "-m", "experiments.accelerator_check", "--smoke", "--stages=environment,loop",
         f"--output_dir={tmp_path}", "--budget_s=600"],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline = time.monotonic() + 300
        # The loop stage records its config as it starts.
        loop_started = tmp_path / "stage_loop.json"
        while not loop_started.exists() and run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert run.poll() is None, run.stdout.read()[-3000:]
        run.send_signal(signal.SIGTERM)
        output, _ = run.communicate(timeout=60)
    finally:
        run.kill()
    assert run.returncode == 130, output[-3000:]
    result = json.loads(output.strip().splitlines()[-1])
    assert result == json.loads((tmp_path / check.RESULT_FILE).read_text())
    assert result["stages"]["environment"]["status"] == "ok" and result["device"]
    assert result["stages"]["loop"]["status"] == "interrupted"
    assert result["loop_config"]  # what the interrupted stage had recorded
    for _ in range(50):
        if not _processes_mentioning(f"--output_dir={tmp_path}"):
            break
        time.sleep(0.2)
    assert _processes_mentioning(f"--output_dir={tmp_path}") == []


def test_the_library_imports_without_what_the_gpu_image_lacks():
    """Train steps, loops, colocation, engine, serving: importable (and their tests collectable) without the
    modules the GPU image does not have; only building a config needs ml_collections."""
    done = _python(
        f"""
        import sys
        for name in {ABSENT_ON_THE_GPU_IMAGE!r}:
            sys.modules[name] = None
        from rstar2jax import agent, engine, eval, models, reward, serve, train
        import rstar2jax.train.policy, rstar2jax.schedules.colocate
        try:
            train.rl_config()
        except ImportError as error:
            print("config:", error)
        """
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "config: import of ml_collections halted" in done.stdout


def test_a_command_past_its_time_is_stopped_with_its_children():
    """The stage runner's clock: the command and the process it started are both gone at the limit."""
    started = time.perf_counter()
    lines = []
    parent = (
        "import subprocess, sys, time; "
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        "print(child.pid, flush=True); time.sleep(60)"
    )
    returncode = check._run_streaming(
        [sys.executable, "-c", parent], env=dict(os.environ), timeout=3, on_line=lines.append
    )
    assert returncode is None
    assert time.perf_counter() - started < 30
    child = int(lines[0])
    for _ in range(50):  # the child was killed with its group; wait for the kernel to reap it
        if not pathlib.Path(f"/proc/{child}").exists() or "Z" in _state(child):
            break
        time.sleep(0.1)
    assert not pathlib.Path(f"/proc/{child}").exists() or "Z" in _state(child)


def _state(pid: int) -> str:
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return "gone"


def test_pytest_outcomes_are_read_from_its_output_and_its_report(tmp_path):
    plain = "tests/models/test_x.py::test_a[1-2] PASSED                     [ 50%]"
    xdist = "[gw3] [ 75%] FAILED tests/train/test_steps.py::test_b "
    assert [m.groupdict() for m in map(check._TEST_LINE.search, (plain, xdist))] == [
        {"before": None, "id1": None, "id2": "tests/models/test_x.py::test_a[1-2]", "after": "PASSED"},
        {"before": "FAILED", "id1": "tests/train/test_steps.py::test_b", "id2": None, "after": None},
    ]
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.models.test_x" name="test_a"/>'
        '<testcase classname="tests.models.test_x" name="test_b"><failure message="assert 1 == 2&#10;more">'
        "trace</failure></testcase>"
        '<testcase classname="" name="tests.train.test_colocate"><error message="collection failure">'
        "tests/train/scripted.py:9: in &lt;module&gt;&#10;    import ml_collections&#10;"
        "E   ModuleNotFoundError: No module named 'ml_collections'</error></testcase>"
        "</testsuite></testsuites>"
    )
    assert check._junit_failures(junit) == {
        "tests/models/test_x.py::test_b": "assert 1 == 2",
        "tests.train.test_colocate": "ModuleNotFoundError: No module named 'ml_collections'",
    }


def test_fp8_decode_is_measured_only_where_the_backend_multiplies_float8(monkeypatch, tmp_path):
    """``fp8_decode_speedup`` (issue 41): FP8 over bfloat16 decode tokens/s where both probes answer yes
    (``bench_engine.fp8_decode_rates``' rates stand in: the measurement is the GPU's), else None and why."""
    from experiments import bench_engine

    shapes = []

    def rates(shape, slots, prompt_len):
        shapes.append((shape, slots, prompt_len))
        return {"bf16": 1000.0, "fp8": 1300.0, "fp8_weights": 1100.0, "fp8_kv": 1200.0}

    monkeypatch.setattr(bench_engine, "fp8_decode_rates", rates)
    monkeypatch.setattr(platform, "fp8_matmul_native", lambda: True)
    record = check.Recorder(tmp_path / "stage_engine.json")
    check.fp8_decode(record, smoke=False)
    assert shapes == [("1.7b", 64, 512)]
    assert record.figures == {"fp8_decode_speedup": 1.3, "fp8_weights_decode_speedup": 1.1,
                              "fp8_kv_decode_speedup": 1.2, "fp8_decode_tokens_per_s": 1300.0,
                              "bf16_decode_tokens_per_s": 1000.0}
    assert json.loads((tmp_path / "stage_engine.json").read_text()) == record.figures
    for probe, why in (("fp8_matmul_native", "no native FP8 matmul"), ("float8_supported", "no float8")):
        monkeypatch.setattr(platform, probe, lambda *args: False)
        record = check.Recorder(tmp_path / f"{probe}.json")
        check.fp8_decode(record, smoke=True)
        assert record.figures["fp8_decode_speedup"] is None and why in record.figures["fp8_decode_why"]
    assert len(shapes) == 1


def test_stage_limits_share_the_time_left():
    stages = list(check.STAGES)
    assert sum(s.share for s in stages) == pytest.approx(1.0)
    assert check.stage_limits(540, stages) == pytest.approx(540 * stages[0].share)
    # A stage that ended early leaves the rest to the stages after it, in proportion.
    last_two = stages[-2:]
    assert check.stage_limits(300, last_two) == pytest.approx(300 * 0.16 / 0.38)


def test_loop_figures_take_compile_time_out_of_the_steps():
    class Events(check.CompileEvents):
        def __init__(self, events):
            self.events = events

    steps = [
        ({"time/step": 50.0, "time/rollout": 30.0, "time/update": 20.0,
          "throughput/rollout_tokens_per_s": 1000.0}, 150.0),
        ({"time/step": 10.0, "time/rollout": 8.0, "time/update": 2.0,
          "throughput/rollout_tokens_per_s": 5000.0}, 161.0),
    ]
    # Compiles that ended inside step 1 (30 s + 10 s) and before it (a memory plan's, not counted).
    figures = check.loop_figures(steps, Events([(90.0, 5.0), (110.0, 30.0), (140.0, 10.0)]), devices=1)
    assert figures["loop_step1_compile_s"] == 40.0 and figures["loop_step2_compile_s"] == 0.0
    assert figures["loop_compile_s"] == 40.0
    assert figures["loop_step1_generated_tokens"] == 30000
    expected = (30000 + 40000) / (10 + 10)  # both steps' tokens over their time without compiling
    assert figures["rl_step_generated_tokens_per_s_per_gpu"] == pytest.approx(expected, 0.01)


def test_the_supported_jax_range_is_the_one_setup_declares():
    requirement = re.search(r'"jax(>=[\d.]+,<[\d.]+)"', (REPO_ROOT / "setup.py").read_text())
    assert requirement and requirement.group(1) == ",".join(platform.SUPPORTED_JAX)
    assert platform.jax_version_supported()  # the JAX the tests run on
    assert platform.jax_version_supported("0.11.2") and platform.jax_version_supported("0.10.2")
    assert not platform.jax_version_supported("0.10.1") and not platform.jax_version_supported("0.12.0")


def test_exact_stage_records_the_issue_keys_on_the_1p7b_shape_in_bfloat16(monkeypatch, tmp_path):
    """The ``exact`` stage (issue 52): ``bench_exact``'s measurements (fakes stand in: the measurement is the
    GPU's) on the Qwen3-1.7B shape in bfloat16, the float32 mismatch only when time is left; the keys are
    the ones the module docstring and the GPU guide name."""
    from experiments import bench_exact
    from rstar2jax import models

    calls = []

    def mismatch(dtype, numerics, *, shape, **sizes):
        calls.append(("mismatch", dtype, numerics, shape))
        return 0.0

    def rates(generate_tokens_per_s, numerics, batches=(1, 16), new_tokens=64, repeats=2, *, dtype, shape):
        calls.append(("decode", dtype, numerics, shape))
        return {1: 100.0, 16: 1000.0} if numerics == "default" else {1: 95.0, 16: 800.0}

    def train(rows, steps, *, dtype, shape):
        calls.append(("train", dtype, shape))
        return {"default": 500.0, "exact": 450.0}

    monkeypatch.setattr(bench_exact, "logprob_mismatch", mismatch)
    monkeypatch.setattr(bench_exact, "decode_rates", rates)
    monkeypatch.setattr(bench_exact, "train_rates", train)
    record = check.Recorder(tmp_path / "stage_exact.json")
    check.exact_numerics(record, smoke=False, deadline=time.perf_counter() + 600)
    qwen = models.preset("qwen3-1.7b")
    decode_turns = [("decode", "bfloat16", numerics, qwen) for numerics in ("default", "exact")] * 2
    assert calls == [("mismatch", "bfloat16", "exact", qwen), *decode_turns, ("train", "bfloat16", qwen),
                     ("mismatch", "float32", "exact", qwen)]
    assert {key: record.figures[key] for key in ("exact_mismatch_max_bf16", "exact_mismatch_max_fp32",
                                                 "exact_decode_ratio", "exact_decode_ratio_b1",
                                                 "exact_decode_ratio_b16", "exact_train_ratio")} == {
        "exact_mismatch_max_bf16": 0.0, "exact_mismatch_max_fp32": 0.0, "exact_decode_ratio": 0.8,
        "exact_decode_ratio_b1": 0.95, "exact_decode_ratio_b16": 0.8, "exact_train_ratio": 0.9}
    assert record.figures["default_decode_tokens_per_s_b16"] == 1000.0
    assert record.figures["exact_kernels"] == "xla"  # the CPU's automatic choice
    assert json.loads((tmp_path / "stage_exact.json").read_text()) == record.figures
    # No time left after the bfloat16 figures: the float32 mismatch is not measured, and the record says why.
    # On a CUDA GPU the automatic choice is the Pallas kernels, and the record says so.
    calls.clear()
    monkeypatch.setattr(models.exact_kernels, "accelerator", lambda: "cuda")
    record = check.Recorder(tmp_path / "late.json")
    check.exact_numerics(record, smoke=True, deadline=time.perf_counter() - 1)
    assert [call[:3] for call in calls if call[0] == "mismatch"] == [("mismatch", "bfloat16", "exact")]
    assert calls[0][3] == bench_exact.SHAPE  # --smoke: bench_engine --exact's tiny shape
    assert record.figures["exact_mismatch_max_fp32"] is None and record.figures["exact_mismatch_fp32_why"]
    assert record.figures["exact_kernels"] == "pallas_triton"
    assert "exact" in check.STAGE_NAMES and "exact" in check.STAGE_FUNCTIONS
    guide = (REPO_ROOT / "docs/guides/gpus.md").read_text()
    for key in ("exact_mismatch_max_fp32", "exact_mismatch_max_bf16", "exact_decode_ratio",
                "exact_train_ratio"):
        assert key in check.__doc__ and key in guide and key in record.figures, key
