"""LoRA training: the step trains the adapters only (the frozen base is also the KL reference), a LoRA RL run
resumes exactly and checks its base, exports a merged HF folder and a PEFT adapter that the serving loaders
read back, and bad LoRA settings are one-line errors."""

import json
import math
import os
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from rstar2jax import models
from rstar2jax.config.parse_model import policy_options
from rstar2jax.policy import adapters as adapters_lib
from rstar2jax.policy.loader import restore_state_params
from rstar2jax.serve import load_policy
from rstar2jax.train import (
    ConfigError,
    RLLossConfig,
    init_train_state,
    make_optimizer,
    make_rl_step,
    make_sft_step,
    parse,
    train_rl,
)
from rstar2jax.train import lora as lora_lib
from rstar2jax.train import policy as policy_lib
from tests.conftest import REPO_ROOT
from tests.train.conftest import FAST_COMPILE, copy_tree
from tests.train.scripted import MAIN_HISTORY, make_scripted_rollout, tiny_rl_config

LORA = models.LoraConfig(rank=4, alpha=8.0)
TIMING = ("time/", "throughput/")


def test_lora_rl_step_trains_the_adapters_only(tiny_model, rl_batch):
    config, params = tiny_model
    optimizer = make_optimizer(1e-2, warmup_steps=0)
    # KL to the reference = the base with the adapters off; two micro-batches.
    step = make_rl_step(config, optimizer, RLLossConfig(kl_coef=0.1), num_microbatches=2, lora=LORA,
                        compiler_options=FAST_COMPILE)
    adapters = models.lora.init_lora(config, LORA, jax.random.key(1))
    base = copy_tree(params)
    state, metrics = step(init_train_state(adapters, optimizer, 0), jax.device_put(rl_batch), base)
    # B = 0 at the start: the policy is the base, so the KL to it is 0.
    assert abs(float(metrics["kl_loss"])) < 1e-6 and float(metrics["grad_norm"]) > 0
    # The base is untouched (not donated, no update); every B moved.
    jax.tree.map(np.testing.assert_array_equal, base, params)
    layers = state.params["layers"]
    moved = {name: float(np.abs(np.asarray(pair["b"])).max()) for name, pair in layers.items()}
    assert all(v > 0 for v in moved.values()), moved
    # Optimizer state of the adapters alone: AdamW's two moments per adapter leaf (+ scalar counters).
    adapter_shapes = sorted(x.shape for x in jax.tree.leaves(state.params))
    moments = sorted(x.shape for x in jax.tree.leaves(state.opt_state) if x.ndim)
    assert moments == sorted(adapter_shapes * 2)


@pytest.mark.slow  # a compile of its own for an option off by default; the masks: tests/models/test_lora.py
def test_lora_sft_dropout_masks_depend_on_the_step_only(tiny_model, rl_batch):
    """SFT with LoRA dropout: the masks of step s come from (state.rng, s), so a resumed run draws the same
    ones, and another step draws others."""
    config, params = tiny_model
    lora = models.LoraConfig(rank=4, dropout=0.5)
    optimizer = make_optimizer(1e-2, warmup_steps=0)
    step = make_sft_step(config, optimizer, num_microbatches=2, lora=lora, compiler_options=FAST_COMPILE)
    adapters = jax.tree.map(lambda x: x + 0.1, models.lora.init_lora(config, lora, jax.random.key(1)))
    batch = jax.device_put(rl_batch)

    def loss_at(step_number):
        state = init_train_state(copy_tree(adapters), optimizer, 0).replace(step=jnp.int32(step_number))
        return float(step(state, batch, params)[1]["loss"])

    assert loss_at(3) == loss_at(3) != loss_at(4)


def _metrics(history):
    return [{k: v for k, v in m.items() if not k.startswith(TIMING)} for m in history]


def _lora_config(workdir, base_dir):
    config = tiny_rl_config(str(workdir))
    config.model.path = str(base_dir)  # an HF folder: what the adapters name as their base
    config.model.lora.rank = 4
    config.model.lora.alpha = 8.0
    config.optimizer.learning_rate = 1e-2
    config.checkpoint.save_every = 1
    return config


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory):
    """The tiny RL recipe's model with its random weights (key 0, as the full-parameter runs of the other
    tests) as an HF folder, and a second base of the same shape with other weights."""
    folder = tmp_path_factory.mktemp("lora-base")
    model_config = parse(tiny_rl_config(str(folder / "unused"))).model
    for name, seed in (("base", 0), ("other", 1)):
        models.save_pretrained(models.init_params(model_config, jax.random.key(seed)), model_config,
                               folder / name)
    return folder / "base", folder / "other"


@pytest.mark.slow  # 28 s on 2 cores; LoRA steps and adapters by default: the tests above, tests/models/
def test_lora_rl_run_resumes_exactly_exports_and_checks_its_base(tmp_path, tiny_base):
    base_dir, other_dir = tiny_base
    reference = _lora_config(tmp_path / "reference", base_dir)
    expected = _metrics(train_rl(parse(reference), rollout_fn=make_scripted_rollout(), max_steps=2))
    # Step 1 samples and scores with the base (B = 0): full fine-tuning's numbers from the same weights (but
    # the gradient norm: the adapters' gradient is another vector).
    first = {k: v for k, v in MAIN_HISTORY[0].items() if k != "grad_norm"}
    assert {k: expected[0][k] for k in first} == pytest.approx(first, rel=1e-5)

    # What a run killed after step 1 leaves: its step-1 checkpoint. It resumes to the same step 2, here with
    # the frozen base and the moments waiting in host memory while the rollout runs (colocation).
    killed = tmp_path / "killed"
    shutil.copytree(tmp_path / "reference", killed)
    shutil.rmtree(killed / "checkpoints" / "2")
    resumed = _lora_config(killed, base_dir)
    resumed.colocate.optimizer_memory = "host"
    resumed = parse(resumed)
    assert _metrics(train_rl(resumed, rollout_fn=make_scripted_rollout(), max_steps=2)) == expected

    # The checkpoint holds the adapters and their optimizer state, not the base.
    step_dir = killed / "checkpoints" / "2"
    meta = json.loads((step_dir / "meta" / "metadata").read_text())
    record = meta[adapters_lib.META_KEY]
    assert record["lora"]["rank"] == 4 and record["name"] == str(base_dir)
    saved = ocp.PyTreeCheckpointer().metadata(step_dir / "state").item_metadata.tree
    assert set(saved["params"]["layers"]) == set(models.LORA_TARGETS) and "embed" not in saved["params"]
    count = sum(math.prod(x.shape) for x in jax.tree.leaves(saved, is_leaf=lambda x: hasattr(x, "shape")))
    assert count <= 3 * models.lora.adapter_parameter_count(resumed.model, LORA) + 8

    # Export: the merged HF folder and the PEFT adapter; both serving paths give the same weights.
    policy = policy_lib.export_policy(resumed, tmp_path / "policy")
    adapter = adapters_lib.adapter_folder(policy)
    assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()
    _, merged = models.load_pretrained(policy)
    tokenizer = str(models.QWEN3_TOKENIZER_DIR)
    from_run = load_policy(killed, tokenizer=tokenizer).params
    from_adapter = load_policy(base_dir, adapter=adapter, tokenizer=tokenizer).params
    for other in (from_run, from_adapter):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), other, merged)
    base_q = models.load_pretrained(base_dir)[1]["layers"]["q_proj"]
    assert not np.allclose(merged["layers"]["q_proj"], base_q)
    # The PEFT folder starts another run where this one stopped (config.model.lora.adapter).
    continued = _lora_config(tmp_path / "continued", base_dir)
    continued.model.lora.adapter = str(adapter)
    start = lora_lib.initial_adapters(policy_options(continued), models.make_mesh())
    saved_adapters = restore_state_params(killed / "checkpoints" / "2" / "state")  # what the run trained
    jax.tree.map(np.testing.assert_array_equal, start, saved_adapters)
    continued.model.lora.rank = 2
    with pytest.raises(ConfigError, match="the adapter has rank=4"):
        policy_options(continued)

    renamed = tmp_path / "Some-Other-Model"  # the same files under a name the adapter does not give
    shutil.copytree(base_dir, renamed)
    moved = load_policy(renamed, adapter=adapter, tokenizer=tokenizer)  # shapes fit: a warning, no refusal
    jax.tree.map(np.testing.assert_array_equal, moved.params, from_adapter)
    with pytest.raises(ValueError, match=f"names base model '{base_dir}', applied to '{renamed}'"):
        load_policy(renamed, adapter=adapter, tokenizer=tokenizer, strict_base=True)

    # The export launcher: the run folder as a plain HF folder, the weights export_policy wrote.
    done = subprocess.run(
        [sys.executable, "-m", "experiments.export", f"--model={killed}", f"--output={tmp_path / 'exported'}",
         f"--tokenizer={tokenizer}"],
        cwd=REPO_ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"exported run {killed}, step 2" in done.stdout
    jax.tree.map(np.testing.assert_array_equal, models.load_pretrained(tmp_path / "exported")[1],
                 models.load_pretrained(policy)[1])
    assert (tmp_path / "exported" / "rstar2jax_prompt.json").is_file()

    # Resuming on another base, with another LoRA shape or as full fine-tuning: one-line errors, before the
    # state is restored.
    for change, message in (
        (lambda c: setattr(c.model, "path", str(other_dir)), "has other weights"),
        (lambda c: setattr(c.model.lora, "rank", 2), "holds adapters of LoRA"),
        (lambda c: setattr(c.model.lora, "rank", 0), "holds LoRA adapters"),
    ):
        config = _lora_config(killed, base_dir)
        change(config)
        with pytest.raises(ConfigError, match=message):
            train_rl(parse(config), rollout_fn=make_scripted_rollout(), max_steps=3)


def test_bad_lora_settings_are_config_errors(tmp_path, tiny_base):
    base_dir, _ = tiny_base
    config = _lora_config(tmp_path / "run", base_dir)
    for path, value, message in (
        ("targets", ("q_proj", "c_attn"), "config.model.lora.targets=('q_proj', 'c_attn'): must list"),
        ("rank", -1, "config.model.lora.rank=-1: must be an integer >= 0"),
        ("dropout", 0.1, "config.model.lora.dropout=0.1: must be 0 in RL"),
    ):
        broken = _lora_config(tmp_path / "run", base_dir)
        setattr(broken.model.lora, path, value)
        with pytest.raises(ConfigError, match=re.escape(message)):
            parse(broken, check_data=False)
    config.model.lora.rank = 33  # the tiny model is 32 wide (q_proj: 4 heads x 16)
    with pytest.raises(ConfigError, match="rank=33 is larger than q_proj's 32 x 64 matrix"):
        policy_options(config)


def test_launchers_refuse_an_adapter_for_another_base_in_one_line(tmp_path, tiny_base):
    """``evaluate --model=BASE --adapter=DIR --strict_base`` with an adapter naming another base: exit 2, one
    line, before any weight is read or the sandbox starts."""
    base_dir, _ = tiny_base
    model_config = models.config_from_hf(base_dir)
    adapters = models.lora.init_lora(model_config, LORA, jax.random.key(0))
    adapter = models.peft_adapter.save_peft_adapter(adapters, model_config, LORA, tmp_path / "adapter",
                                                    base_model="org/Another-Model")
    done = subprocess.run(
        [sys.executable, "-m", "experiments.evaluate", f"--model={base_dir}", f"--adapter={adapter}",
         f"--workdir={tmp_path / 'eval'}", f"--tokenizer={models.QWEN3_TOKENIZER_DIR}", "--datasets=aime24",
         "--strict_base"],
        cwd=REPO_ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "names base model 'org/Another-Model'" in lines[0], done.stderr


def test_14b_lora_config_fits_one_80_gib_gpu(tmp_path):
    """``python -m experiments.train_rl --config=experiments/configs/paper_qwen3_14b_lora_1gpu.py --dry_run``:
    the paper's recipe with LoRA, compiled on abstract shapes; both phases fit 80 GiB at its longest stage."""
    from experiments.configs import paper_qwen3_14b_lora_1gpu
    from rstar2jax.train.dry_run_report import check_memory_plan, dry_run

    config = paper_qwen3_14b_lora_1gpu.get_config()
    config.workdir = str(tmp_path)
    options = parse(config, check_data=False)
    report = dry_run(options)
    check_memory_plan(options, report=report)
    plan = json.loads((tmp_path / "memory_plan.json").read_text())
    assert plan["device_memory_gib"] == 80.0 and plan["fits"] is True
    assert 0 < plan["rollout_peak_gib"] <= 80.0 and 0 < plan["train_peak_gib"] <= 80.0
    # The frozen bfloat16 base (14.8B x 2 bytes) waits in host memory while the merged copy samples.
    assert plan["frozen_base_gib"] == pytest.approx(report["frozen_params"] * 2 / 2**30)
    assert plan["optimizer_offloaded_during_rollout"]
    assert plan["engine_weight_cast_gib"] == plan["frozen_base_gib"]  # the merged copy, bfloat16 as well
    assert report["lora"]["rank"] == 16 and report["num_params"] < 0.005 * report["frozen_params"]
