"""Invalid configs fail before any compute, naming the field; the shipped configs are valid."""

import json

import pytest

from experiments import _launch
from experiments.configs import demo, paper_qwen3_14b, tiny_cpu
from rstar2jax.train import (
    ConfigError,
    stage,
    train_rl,
    train_sft,
    validate,
    validate_rl_config,
    validate_sft_config,
)
from rstar2jax.train.config import build_iteration_config, field_help, rl_config, row_multiple


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
        ("loss.importance_sampling_level", "row", "config.loss.importance_sampling_level='row'"),
        ("loss.gspo_eps_low", 0.0, "config.loss.gspo_eps_low=0.0"),
        ("loss.kl_coef", -0.1, "config.loss.kl_coef=-0.1"),
        ("loss.kl", "k4", "config.loss.kl='k4'"),
        ("loss.rollout_is_cap", 0.9, "config.loss.rollout_is_cap=0.9"),
        ("loss.rollout_mask", "token", "config.loss.rollout_mask='token'"),
        ("loss.rollout_mask_threshold", 1.0, "config.loss.rollout_mask_threshold=1.0"),
        ("loss.rollout_is_cap", 2.0, "config.loss.rollout_is_cap / loss.rollout_mask"),  # needs recompute
        ("rl.format_penalty", "strict", "config.rl.format_penalty='strict'"),
        ("rl.overlong_buffer", -1, "config.rl.overlong_buffer=-1"),
        ("rl.overlong_buffer", 10**6, "config.rl.overlong_buffer=1000000 is longer than stages[0]"),
        ("rl.overlong_penalty_factor", -1.0, "config.rl.overlong_penalty_factor=-1.0"),
        ("mesh.fsdp", 0, "config.mesh.fsdp=0"),
        ("optimizer.learning_rate", -1.0, "config.optimizer.learning_rate=-1.0"),
        ("optimizer.schedule", "linear", "config.optimizer.schedule='linear'"),
        ("model.remat_policy", "some", "config.model.remat_policy='some'"),
        ("checkpoint.keep", 0, "config.checkpoint.keep=0"),
        ("distributed.process_id", 3, "config.distributed.process_id=3"),
        ("tokenizer", "/nonexistent/tok", "config.tokenizer='/nonexistent/tok'"),
        ("model.spec.vocab_size", 256, None),  # valid
        ("rl.off_policy_steps", 2, "config.rl.off_policy_steps=2"),
        ("rollout.partial_token_budget", -5, "config.rollout.partial_token_budget=-5"),
        ("rollout.partial_segment_tokens", 0, "config.rollout.partial_segment_tokens=0"),
        ("rl.off_policy_steps", 1, "config.rl.off_policy_steps=1 trains on tokens an older policy"),
        ("rollout.partial_token_budget", 100, "config.rollout.partial_token_budget > 0 trains on tokens"),
        ("rollout.sandbox_outage_s", 0.0, "config.rollout.sandbox_outage_s=0.0: must be a positive number"),
        ("rollout.sandbox_outage_s", float("inf"), "config.rollout.sandbox_outage_s=inf"),
        ("rl.max_nonfinite_steps", 0, "config.rl.max_nonfinite_steps=0: must be a positive integer"),
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
    validate_rl_config(config)  # packed rows aggregate per sequence (segment), as padded ones do
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

    # Rollouts across an update: with the rollout correction each option is valid, the two together not.
    config = tiny_cpu.get_config()
    config.loss.old_logprobs, config.loss.rollout_is_cap = "recompute", 2.0
    config.rl.off_policy_steps = 1
    validate_rl_config(config)
    config.rollout.partial_token_budget = 64
    with pytest.raises(ConfigError, match="do not combine"):
        validate_rl_config(config)
    config.rl.off_policy_steps = 0
    validate_rl_config(config)
    config.distributed.num_processes = 2
    with pytest.raises(ConfigError, match="one process"):
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


def test_missing_local_problem_files_fail_unless_dry_run(tmp_path):
    config = tiny_cpu.get_config()
    config.data.source = str(tmp_path / "rl.jsonl")
    with pytest.raises(ConfigError, match=r"^config.data.source='.*rl.jsonl': does not exist \(a local path"):
        validate_rl_config(config)
    validate_rl_config(config, check_data=False)  # a dry run needs no problems
    config.data.source = "org/hub_set"  # a hub name is not checked here
    validate_rl_config(config)
    config.stages[1].dataset = "data/hard.parquet"
    with pytest.raises(ConfigError, match=r"^config.stages\[1\].dataset='data/hard.parquet': does not exist"):
        validate_rl_config(config)
    paper = paper_qwen3_14b.get_config()  # its problem set is a placeholder path: fine for --dry_run
    validate(paper, "rl", check_data=False)
    with pytest.raises(ConfigError, match="config.data.source='data/rstar2_agent_rl_42k.jsonl': does not"):
        validate(paper, "rl")


def test_validate_checks_each_content_once(monkeypatch, tmp_path):
    from rstar2jax.train import validation

    calls = []
    original = validation.validate_sft_config
    monkeypatch.setattr(
        validation, "validate_sft_config", lambda c, **kw: (calls.append(kw), original(c, **kw))
    )
    sft = tiny_cpu.get_config("sft")
    sft.sft.data = str(tmp_path / "missing.jsonl")
    validate(sft, "sft", check_data=False)
    validate(sft, "sft", check_data=False)  # the same content: not checked again
    assert calls == [{"check_data": False, "check_paths": True}]
    with pytest.raises(ConfigError, match="config.sft.data="):  # a stricter check still runs
        validate(sft, "sft")
    (tmp_path / "missing.jsonl").write_text("")
    validate(sft, "sft")
    validate(sft, "sft", check_data=False)
    assert len(calls) == 3
    validate(sft, "sft", check_paths=False)  # a weaker check than one passed: not run
    assert len(calls) == 3
    sft.tokenizer = str(tmp_path / "no_tokenizer")
    validate(sft, "sft", check_paths=False)  # a later phase's config, before its files exist
    with pytest.raises(ConfigError, match="config.tokenizer=.*no_tokenizer': is not a tokenizer folder"):
        validate(sft, "sft")
    sft.tokenizer = ""
    sft.sft.epochs = 0  # changed content: checked again
    with pytest.raises(ConfigError, match=r"^config.sft.epochs=0: must be a positive integer$"):
        validate(sft, "sft")
    with pytest.raises(ValueError, match="kind='eval'"):
        validate(sft, "eval")


def test_shipped_configs():
    paper = paper_qwen3_14b.get_config()
    validate_rl_config(paper, check_data=False)  # its problem set is a placeholder path (see below)
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


#: Every shipped config with every launcher that makes sense for it: (config module, get_config argument,
#: kind the launcher trains). The demo's phases point into a demo work folder (checked without its files).
LAUNCHABLE = [
    (tiny_cpu, "rl", "rl"),  # experiments.train_rl
    (tiny_cpu, "sft", "sft"),  # experiments.sft
    (paper_qwen3_14b, "rl", "rl"),  # experiments.train_rl (--dry_run here; a cluster for real)
    (paper_qwen3_14b, "sft", "sft"),  # experiments.sft
    (demo, "sft", "sft"),  # experiments.sft on a demo run's files
    (demo, "rl,runs/other_demo", "rl"),  # experiments.train_rl on a demo run's files
]


@pytest.mark.parametrize("module, argument, kind", LAUNCHABLE)
def test_shipped_configs_for_every_launcher(module, argument, kind):
    config = module.get_config(argument)
    validate(config, kind, check_data=False, check_paths=module is not demo)
    lines = _launch.describe_config(config)  # --print_config: every field has a meaning
    assert lines and not [line for line in lines if line.endswith("# (no description)")]
    if module is demo:
        assert config.workdir.startswith("runs/other_demo/" if "," in argument else "runs/demo/")
        assert "python -m experiments.demo" in config.notice
    if kind == "rl":  # the policy is prompted as its SFT data were written
        expected = demo.get_config().prompt if module is demo else {"paper": None}  # the policy's own
        assert config.prompt.paper == expected["paper"]
    if module is tiny_cpu:
        assert "smoke test" in config.notice
    with pytest.raises(ValueError, match="kind='eval'"):
        module.get_config("eval")


def test_demo_config_fields_all_have_a_meaning():
    lines = _launch.describe_config(demo.get_config(), demo.FIELD_HELP)
    assert len(lines) > 100 and not [line for line in lines if line.endswith("# (no description)")]


def test_model_path_wins_over_an_inline_model_and_brings_its_tokenizer(tmp_path, tiny_model):
    """``--config.model.path=<an exported policy>`` on a config with an inline model starts from the policy;
    an empty ``config.tokenizer`` then means the folder's own tokenizer."""
    from rstar2jax import models
    from rstar2jax.data.tokenizer import train_tiny_tokenizer
    from rstar2jax.train.config import tokenizer_path
    from rstar2jax.train.run import model_config_from

    model_config, params = tiny_model
    folder = tmp_path / "policy"
    models.save_pretrained(params, model_config, folder)
    config = tiny_cpu.get_config()
    config.tokenizer = ""
    config.model.path = str(folder)
    assert len(config.model.spec)  # the inline model is still there ...
    validate_rl_config(config, check_data=False)
    loaded = model_config_from(config)  # ... and the folder's model wins
    assert (loaded.vocab_size, loaded.hidden_size, loaded.num_layers) == (128, 32, 2)
    assert tokenizer_path(config) == ""  # no tokenizer in the folder: none
    train_tiny_tokenizer(["x"], 300, folder)
    assert tokenizer_path(config) == str(folder)
    config.tokenizer = str(tmp_path / "other")
    assert tokenizer_path(config) == str(tmp_path / "other")  # an explicit tokenizer wins


def test_the_prompt_is_the_model_folders_unless_the_config_says(tmp_path, tiny_model):
    """``prompt.paper`` None (the default) prompts in the format an exported policy records
    (``save_pretrained(..., prompt=)``); a folder recording none, and no folder, give the paper's prompt;
    True / False say it in the config. A format file that does not parse fails validation, naming it."""
    from rstar2jax import models
    from rstar2jax.data.conversation import PROMPT_CONFIG_FILE, PromptConfig
    from rstar2jax.train.config import prompt_from_config

    model_config, params = tiny_model
    config = tiny_cpu.get_config()
    assert config.prompt.paper is None and prompt_from_config(config) == PromptConfig()
    recorded = PromptConfig(system_prompt="", assistant_opener="<think>", list_tools=False)
    models.save_pretrained(params, model_config, tmp_path / "plain")
    models.save_pretrained(params, model_config, tmp_path / "policy", prompt=recorded)
    config.model.path = str(tmp_path / "plain")
    assert prompt_from_config(config) == PromptConfig()
    config.model.path = str(tmp_path / "policy")
    assert prompt_from_config(config) == recorded
    validate_rl_config(config, check_data=False)
    config.prompt.paper = True
    assert prompt_from_config(config) == PromptConfig()
    config.prompt.paper, config.prompt.system_prompt = False, "Be brief."
    assert prompt_from_config(config) == PromptConfig(system_prompt="Be brief.", user_prefix="")
    config.prompt.paper = None
    (tmp_path / "policy" / PROMPT_CONFIG_FILE).write_text("{")
    with pytest.raises(ConfigError, match=f"config.model.path=.*{PROMPT_CONFIG_FILE}: not valid JSON"):
        validate_rl_config(config, check_data=False)


def test_model_preset_field():
    from rstar2jax import models
    from rstar2jax.train.run import model_config_from

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


def test_choice_fields_list_exactly_the_allowed_values_and_rl_defaults_are_the_iterations():
    import dataclasses
    import re

    from rstar2jax import algo
    from rstar2jax.train import RLIterationConfig

    for path, allowed in (
        ("rl.roc_mode", algo.ROC_MODES),
        ("rl.format_penalty", algo.FORMAT_PENALTIES),
        ("rl.std", algo.STD_MODES),
    ):
        listed = re.findall(r"(?:^|/ )(\w+) \(", field_help(path).split(": ", 1)[1])
        assert tuple(listed) == allowed, (path, field_help(path))
    defaults = rl_config().rl
    for f in dataclasses.fields(RLIterationConfig):
        if f.name not in ("seq_len", "pack", "row_multiple"):
            assert defaults[f.name] == f.default, f.name
    assert defaults.std == "unbiased"


def test_run_options_are_the_configs_values_typed_and_frozen():
    import dataclasses

    from rstar2jax.train import StageOptions, run_options

    config = tiny_cpu.get_config()
    config.batch.pack = False
    config.data.answer_field = "solution"
    options = run_options(config)
    assert options.stages[1] == StageOptions("stage2", 2, 96, 3, hard_filter_rollouts=2, reset_optimizer=True)
    assert options.total_steps == 4 and options.rl.num_rows == 2 * 2 and options.rl.prompts_per_step == 2
    assert options.data.answer_field == "solution" and options.data.problem_field is None  # '' -> guess
    assert options.checkpoint.save_every == 1 and options.logging.progress_every == 10
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.seed = 1
    assert options.sft is None and options.num_microbatches == 2 and options.row_multiple == 2
    sft = run_options(tiny_cpu.get_config("sft"))
    assert sft.stages == () and sft.rl is None and sft.data is None and sft.checkpoint.save_every == 5
    assert (sft.sft.epochs, sft.sft.batch_size, sft.sft.seq_len, sft.sft.steps) == (1, 8, 1024, None)


def test_run_options_carry_the_typed_objects_the_library_reads():
    """One conversion gives the trainer and the rollout engine the same model, and every typed option the
    run lifecycle, the memory plan and the rollout read; converting touches no device."""
    from jax._src import xla_bridge

    from rstar2jax.engine import EngineConfig, SamplingParams
    from rstar2jax.train import run_options
    from rstar2jax.train.options import MeshShape
    from rstar2jax.train.run import model_config_from

    config = tiny_cpu.get_config()
    config.rollout.kv_cache_tokens = 4096
    config.rollout.temperature = 0.7
    config.loss.kl_coef = 0.1
    started = dict(xla_bridge._backends)
    options = run_options(config)
    assert dict(xla_bridge._backends) == started  # before prepare_process, nothing may start JAX
    assert run_options(options) is options  # entry points that accept either convert once
    assert options.model == model_config_from(config) and options.lora is None
    assert options.mesh == MeshShape(**config.mesh.to_dict()) and options.distributed.num_processes == 1
    assert options.uses_reference and options.rl.loss.kl_coef == 0.1
    rollout = options.rl.rollout
    assert rollout.engine == EngineConfig(
        num_slots=config.rollout.engine_slots, seed=config.seed, num_pages=4096 // EngineConfig.page_size + 1
    )
    assert rollout.sampling == SamplingParams(temperature=0.7, top_p=1.0, top_k=0)
    stage = options.stages[1]
    iteration = options.rl.iteration_for(stage.max_response_length)
    assert iteration == build_iteration_config(config, stage.max_response_length)
    assert options.optimizer.learning_rate == config.optimizer.learning_rate
    assert json.loads(options.record) == json.loads(config.to_json_best_effort())  # run_config.json
