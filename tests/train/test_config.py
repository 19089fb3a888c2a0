"""Invalid configs fail before any compute, naming the field; the shipped configs are valid."""

import pytest

from experiments.configs import paper_qwen3_14b, tiny_cpu
from rstar2jax.train import ConfigError, stage, train_rl, train_sft, validate_rl_config, validate_sft_config
from rstar2jax.train.config import build_iteration_config, row_multiple


def _set(config, path, value):
    *parents, leaf = path.split(".")
    node = config
    for part in parents:
        node = node[int(part)] if part.isdigit() else node[part]
    node[leaf] = value


@pytest.mark.parametrize(
    "path, value, message",
    [
        ("rl.keep", 40, "config.rl.keep=40"),
        ("rl.samples_per_problem", 1, "config.rl.samples_per_problem=1"),
        ("rl.roc_mode", "greedy", "config.rl.roc_mode='greedy'"),
        ("rl.std", "sample", "config.rl.std='sample'"),
        ("loss.agg", "sum", "config.loss.agg='sum'"),
        ("loss.eps_low", 1.5, "config.loss.eps_low=1.5"),
        ("loss.dual_clip", 0.5, "config.loss.dual_clip=0.5"),
        ("loss.old_logprobs", "engine", "config.loss.old_logprobs='engine'"),
        ("mesh.fsdp", 0, "config.mesh.fsdp=0"),
        ("optimizer.learning_rate", -1.0, "config.optimizer.learning_rate=-1.0"),
        ("optimizer.schedule", "linear", "config.optimizer.schedule='linear'"),
        ("model.remat_policy", "some", "config.model.remat_policy='some'"),
        ("checkpoint.keep", 0, "config.checkpoint.keep=0"),
        ("distributed.process_id", 3, "config.distributed.process_id=3"),
        ("tokenizer", "/nonexistent/tok", "config.tokenizer='/nonexistent/tok'"),
        ("model.spec.vocab_size", 256, None),  # valid
    ],
)
def test_invalid_field_is_named(path, value, message):
    config = tiny_cpu.get_config()
    _set(config, path, value)
    if message is None:
        validate_rl_config(config)
        return
    with pytest.raises(ConfigError) as error:
        validate_rl_config(config)
    assert str(error.value).startswith(message)


def test_structural_errors():
    config = tiny_cpu.get_config()
    config.stages = [
        stage("a", steps=1, max_response_length=8, max_turns=1),
        stage("b", steps=0, max_response_length=8, max_turns=1),
    ]
    with pytest.raises(ConfigError, match=r"config\.stages\[1\]\.steps=0"):
        validate_rl_config(config)
    config.stages = []
    with pytest.raises(ConfigError, match=r"config\.stages=\[\]"):
        validate_rl_config(config)

    config = tiny_cpu.get_config()
    config.model.config_json = "/work/nothing.json"
    with pytest.raises(ConfigError, match="config.model: set exactly one"):
        validate_rl_config(config)

    config = tiny_cpu.get_config()
    config.loss.agg = "seq_mean_token_mean"
    with pytest.raises(ConfigError, match="config.batch.pack=True"):
        validate_rl_config(config)
    config.batch.pack = False
    config.rl.prompts_per_step = 3  # 3 x 2 = 6 rows: 2 micro-batches x 1 data shard divide them
    validate_rl_config(config)
    config.num_microbatches = 4
    with pytest.raises(ConfigError, match="multiple of num_microbatches"):
        validate_rl_config(config)

    config = tiny_cpu.get_config()
    config.data.source = ""
    with pytest.raises(ConfigError, match="config.data.source is empty"):
        validate_rl_config(config)


def test_fails_before_any_compute(tmp_path):
    config = tiny_cpu.get_config()
    config.workdir = str(tmp_path / "run")
    config.rl.keep = 0

    def rollout_fn(*args, **kwargs):
        raise AssertionError("no rollout may start")

    with pytest.raises(ConfigError, match="config.rl.keep=0"):
        train_rl(config, rollout_fn=rollout_fn)
    sft = tiny_cpu.get_config("sft")
    sft.workdir = str(tmp_path / "run")
    sft.sft.data = str(tmp_path / "missing.jsonl")
    with pytest.raises(ConfigError, match="config.sft.data="):
        train_sft(sft)
    validate_sft_config(sft, check_data=False)
    assert not (tmp_path / "run").exists()


def test_shipped_configs():
    paper = paper_qwen3_14b.get_config()
    validate_rl_config(paper)
    assert (paper.rl.prompts_per_step, paper.rl.samples_per_problem, paper.rl.keep) == (512, 32, 16)
    assert [(s.max_response_length, s.steps, s.max_turns) for s in paper.stages] == [
        (8192, 300, 10),
        (12288, 85, 10),
        (12288, 125, 15),
    ]
    assert [s.reset_optimizer for s in paper.stages] == [False, False, True]
    assert paper.stages[2].hard_filter_rollouts == 8
    assert (
        paper.optimizer.learning_rate,
        paper.optimizer.warmup_steps,
        paper.optimizer.weight_decay,
        paper.optimizer.max_grad_norm,
        paper.optimizer.schedule,
    ) == (1e-6, 20, 0.01, 1.0, "constant")
    assert (paper.loss.eps_low, paper.loss.eps_high, paper.loss.entropy_coef) == (0.2, 0.28, 0.0)
    assert paper.mesh.data * paper.mesh.fsdp * paper.mesh.tensor == 64
    assert (512 * 16) % row_multiple(paper) == 0
    iteration = build_iteration_config(paper, 12288)
    assert iteration.seq_len == paper.batch.max_prompt_length + 12288 - 1 and iteration.keep == 16
    sft = paper_qwen3_14b.get_config("sft")
    validate_sft_config(sft, check_data=False)
    assert (sft.optimizer.learning_rate, sft.optimizer.schedule, sft.sft.epochs, sft.sft.batch_size) == (
        5e-6,
        "cosine",
        3,
        128,
    )
    with pytest.raises(ValueError, match="kind='eval'"):
        tiny_cpu.get_config("eval")


def test_model_preset_field():
    from rstar2jax import models
    from rstar2jax.train.runner import model_config_from

    config = tiny_cpu.get_config()  # preset "tiny" refined by spec fields (the real Qwen3 vocabulary)
    expected = models.preset("tiny", vocab_size=151936, eos_token_ids=(151645, 151643))
    assert model_config_from(config) == expected
    paper = paper_qwen3_14b.get_config()
    assert model_config_from(paper) == models.preset(
        "qwen3-14b", compute_dtype="bfloat16", remat_policy="full"
    )
    config.model.preset = "qwen3-15b"
    with pytest.raises(ConfigError, match=r"config.model.preset='qwen3-15b': must be one of \('tiny'"):
        validate_rl_config(config)
