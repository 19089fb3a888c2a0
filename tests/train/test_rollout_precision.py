"""A low-precision rollout from the run config (issue 41): ``rollout.weight_dtype`` / ``kv_dtype`` / ... reach
the engine, token-level TIS is on by default when the rollout's precision differs from the trainer's,
turning every correction off takes ``loss.allow_uncorrected_mismatch`` (and the run warns once), and what the
backend cannot run is a ``ConfigError`` naming the field before any work. Parsing only: nothing compiles."""

import logging
import types

import pytest

from experiments import _launch
from experiments.configs import tiny_cpu
from rstar2jax.engine import paged_attention
from rstar2jax.models import platform
from rstar2jax.train import ConfigError, check_rollout_precision, parse
from rstar2jax.train.rl_loop import _rollout_precision
from tests.train.scripted import set_fields

FP8 = {"rollout.weight_dtype": "fp8", "rollout.kv_dtype": "fp8", "rollout.weight_block": 32}


def _config(**fields):
    return set_fields(tiny_cpu.get_config(), fields)


def _parse(fields: dict):
    return parse(_config(**fields))


def test_precision_fields_reach_the_engine_and_fp8_turns_token_tis_on():
    plain = _parse({})
    assert (plain.rl.loss.old_logprobs, plain.rl.loss.rollout_is_cap) == ("sampler", None)  # as before
    engine = plain.rl.rollout.engine
    assert (engine.weight_dtype, engine.kv_dtype, engine.weight_block, engine.attention) == (
        None, None, 128, "auto")
    options = _parse({**FP8, "rollout.fp8_matmul": "reference", "rollout.attention": "jnp"})
    engine = options.rl.rollout.engine
    assert (engine.weight_dtype, engine.kv_dtype, engine.weight_block, engine.fp8_matmul) == (
        "fp8", "fp8", 32, "reference")
    assert engine.attention == "blockwise"  # the old name, stored as its new one
    loss = options.rl.loss
    assert (loss.old_logprobs, loss.rollout_is_cap, loss.rollout_correction) == ("recompute", 2.0, True)
    # Either half alone differs from the trainer's float32; KV pages in the compute dtype do not.
    for fields in ({"rollout.kv_dtype": "fp8"}, {"rollout.kv_dtype": "bfloat16"},
                   {"rollout.weight_dtype": "fp8", "rollout.weight_block": 16}):
        assert _parse(fields).rl.loss.rollout_is_cap == 2.0, fields
    assert _parse({"rollout.kv_dtype": "float32"}).rl.loss.rollout_is_cap is None
    # An explicit cap (a command line's int too) or a sequence mask is kept as it is.
    assert _parse({**FP8, "loss.rollout_is_cap": 3}).rl.loss.rollout_is_cap == 3.0
    masked = _parse({**FP8, "loss.rollout_is_cap": None, "loss.rollout_mask": "geometric"}).rl.loss
    assert (masked.rollout_is_cap, masked.rollout_mask, masked.old_logprobs) == (
        None, "geometric", "recompute")
    head = _parse({**FP8, "rollout.quantize_head": True}).rl.rollout.engine
    assert head.quantize_head and parse(_config(**FP8)).rl.rollout.engine.quantize_head is False


def test_uncorrected_fp8_rollout_needs_the_flag_and_the_run_warns_once(caplog):
    """(The refusals: ``bad_options.CONTRADICTIONS``, walked by the config and launcher tests.)"""
    with pytest.raises(ConfigError, match="or set loss.allow_uncorrected_mismatch=True to train uncorrected"):
        _parse({**FP8, "loss.rollout_is_cap": None})
    options = _parse({**FP8, "loss.rollout_is_cap": None, "loss.allow_uncorrected_mismatch": True})
    assert not options.rl.loss.rollout_correction
    run = types.SimpleNamespace(options=options, is_main=True)
    with caplog.at_level(logging.WARNING, logger="rstar2jax"):
        assert _rollout_precision(run) == "fp8 weights and fp8 KV pages"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "every rollout correction is off" in warnings[0]
    assert "loss.allow_uncorrected_mismatch=True" in warnings[0] and "\n" not in warnings[0]
    caplog.clear()
    for fields in (FP8, {}):  # corrected, or nothing to correct: no warning
        assert _rollout_precision(types.SimpleNamespace(options=_parse(fields), is_main=True)) == (
            "fp8 weights and fp8 KV pages" if fields else "")
    assert not caplog.records


def test_what_the_backend_cannot_run_is_a_config_error_before_any_work(monkeypatch, tmp_path):
    """No float8 on the backend (monkeypatched: this CPU has it), or FP8 pages with a decode kernel that does
    not compile for them: the launchers' start (``_launch.prologue``) and ``train_rl`` raise a ConfigError
    naming the field, and nothing is written."""
    from rstar2jax import train

    check_rollout_precision(_parse(FP8))  # this CPU runs FP8
    monkeypatch.setattr(platform, "float8_supported", lambda device=None: False)
    for fields, named in (({"rollout.weight_dtype": "fp8", "rollout.weight_block": 32}, "weight_dtype='fp8'"),
                          ({"rollout.kv_dtype": "fp8"}, "kv_dtype='fp8'")):
        with pytest.raises(ConfigError, match=rf"^config\.rollout\.{named}: .*needs float8_e4m3fn"):
            check_rollout_precision(_parse(fields))
    check_rollout_precision(_parse({}))  # nothing in FP8: nothing to check
    workdir = tmp_path / "run"
    config = _config(**FP8, workdir=str(workdir))
    with pytest.raises(ConfigError, match=r"^config\.rollout\.weight_dtype='fp8'"):
        _launch.prologue(config, kind="rl", title="rl", dry_run=False, print_fields=False)
    with pytest.raises(ConfigError, match=r"^config\.rollout\.weight_dtype='fp8'"):
        train.train_rl(parse(config), rollout_fn=None)
    assert not workdir.exists()
    monkeypatch.undo()
    monkeypatch.setattr(paged_attention, "pallas_reads_fp8", lambda: False)
    with pytest.raises(ConfigError, match=r"^config\.rollout\.attention='pallas_triton': .*cannot read FP8"):
        check_rollout_precision(_parse({"rollout.kv_dtype": "fp8", "rollout.attention": "pallas_triton"}))
    check_rollout_precision(_parse({"rollout.kv_dtype": "fp8"}))  # "auto" falls back to blockwise


_FP8_ARM = """
import dataclasses, json
from experiments import ablate_roc
from experiments.configs import demo
from rstar2jax.train import parse

config, paths = demo.get_config(), demo.DemoPaths("runs/x")
def options(run):
    return parse(demo.before_files(run, config), check_data=False)
fp8_run = ablate_roc.arm_run_config(config, paths, "fp8", seed=1)
fp8, plain = options(fp8_run), options(ablate_roc.trainer_precision(fp8_run))
paper_run = ablate_roc.arm_run_config(config, paths, "paper", seed=1)
paper = options(paper_run)
engine = fp8.rl.rollout.engine
print(json.dumps(dict(
    engine=[engine.weight_dtype, engine.kv_dtype, engine.weight_block],
    loss=[fp8.rl.loss.old_logprobs, fp8.rl.loss.rollout_is_cap, paper.rl.loss.rollout_is_cap],
    evaluator_is_papers=plain.rl.rollout.engine == paper.rl.rollout.engine,
    paper_is_its_own_evaluator=ablate_roc.trainer_precision(paper_run).rollout == paper_run.rollout,
    same_otherwise=dataclasses.replace(engine, weight_dtype=None, kv_dtype=None, weight_block=128)
    == paper.rl.rollout.engine,
    seed=[fp8.seed, fp8.rl.iterations[0].roc_mode])))
"""


def test_the_fp8_ablation_arm_samples_in_fp8_with_tis_and_is_evaluated_in_the_trainers_precision():
    """``ablate_roc --modes=paper,fp8``: the fp8 arm is the paper arm with the demo model's FP8 rollout
    (64 x 64 blocks: the largest edge dividing its projections) and the TIS default; its final policy is
    evaluated by the paper arm's engine. (A subprocess: the launcher module defines its absl flags on
    import.)"""
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _FP8_ARM], capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result == dict(engine=["fp8", "fp8", 64], loss=["recompute", 2.0, None], evaluator_is_papers=True,
                          paper_is_its_own_evaluator=True, same_otherwise=True, seed=[1, "paper"])


@pytest.mark.parametrize("launcher, args", [
    ("experiments.demo", ["--config.rl.rollout.weight_dtype=fp8", "--config.rl.rollout.weight_block=64"]),
    ("experiments.ablate_roc", ["--modes=paper,fp8", "--seeds=0", "--workdir={out}"]),
])
def test_the_demo_launchers_refuse_what_the_backend_cannot_run_before_any_work(launcher, args, tmp_path):
    """The demo and the ablation check every phase's rollout precision on this backend (float8 made absent
    here) before they write anything: exit 2, one line naming the field (``tests/train/bad_options.py``'s
    driver, as ``test_every_bad_option_gets_one_line`` runs the training launchers)."""
    import json
    import subprocess
    import sys

    # The driver sets the demo's work folder (config.workdir) and reports whether it appeared.
    case = {"args": [*(a.format(out=tmp_path / "out") for a in args), "--compile_cache="],
            "refuse": "rstar2jax.models.platform:float8_supported"}
    (tmp_path / "cases.json").write_text(json.dumps([case]))
    config, cases = "experiments/configs/demo.py", str(tmp_path / "cases.json")
    driver = ["tests.train.bad_options", launcher, config, cases, str(tmp_path / "runs")]
    done = subprocess.run([sys.executable, "-m", *driver], capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    [result] = json.loads(done.stdout.splitlines()[-1])
    lines = result["stderr"].splitlines()
    assert result["status"] == 2 and len(lines) == 1, result
    assert lines[0].startswith("error: config.rollout.weight_dtype='fp8': weight_dtype='fp8' needs float8")
    assert not result["wrote"] and not (tmp_path / "out").exists(), result


def test_an_fp8_rollout_under_the_asynchronous_schedule_is_corrected_by_the_decoupled_weights():
    """'auto' under the decoupled objective sets no TIS cap (its truncated behaviour weight already compares
    the trainer with the FP8 sampler), and an explicit cap beside it is still refused."""
    config = tiny_cpu.get_config()
    set_fields(config, {"rl.schedule": "async", "rollout.weight_dtype": "fp8", "rollout.kv_dtype": "fp8",
                        "rollout.weight_block": 16})
    loss = parse(config, check_data=False).rl.loss
    assert loss.off_policy_correction == "decoupled"
    assert (loss.rollout_is_cap, loss.old_logprobs) == (None, "recompute")
    config.loss.rollout_is_cap = 2.0
    with pytest.raises(ConfigError, match="config.loss.rollout_is_cap=2.0: the decoupled objective"):
        parse(config, check_data=False)
