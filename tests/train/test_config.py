"""Invalid configs fail before any compute, naming the field; the shipped configs are valid."""

import dataclasses
import json

import pytest

from experiments import _launch
from experiments.configs import demo, paper_qwen3_14b, paper_qwen3_14b_lora_1gpu, qwen3_1p7b_1gpu, tiny_cpu
from experiments.configs.demo import before_files
from rstar2jax.config.config import rl_config
from rstar2jax.config.field_help import field_help
from rstar2jax.train import ConfigError, parse, stage
from tests.train.bad_options import CONTRADICTIONS, bad_values, set_path


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
        ("tokenizer", "/nonexistent/tok", "config.tokenizer='/nonexistent/tok': is not a folder"),
        ("rollout.temperature", -1.0, "config.rollout.temperature=-1.0: must be positive"),
        ("rollout.top_p", 0.0, "config.rollout.top_p=0.0: must be in (0, 1]"),
        ("seed", -1, "config.seed=-1: must be an integer >= 0"),
        ("rollout.engine_slots", 3, "config.rollout.engine_slots=3: must be at least rl.samples_per_problem"),
        ("rollout.kv_cache_tokens", 100, "config.rollout.kv_cache_tokens=100: must be 0 (every slot"),
        ("rollout.sandbox_url", "localhost:8000", "config.rollout.sandbox_url='localhost:8000'"),
        ("model.lora.targets", ("q_proj", "q_proj"), "config.model.lora.targets=('q_proj', 'q_proj')"),
        ("model.spec.vocab_size", 0, "config.model.spec.vocab_size=0: vocab_size must be a positive int"),
        ("model.spec.eos_token_ids", (-1,), "config.model.spec.eos_token_ids=(-1,): token ids must be"),
        ("optimizer.b2", 1.0, "config.optimizer.b2=1.0: must be in [0, 1)"),
        ("data.limit", 0, "config.data.limit=0: must be a positive integer or None"),
        ("model.spec.vocab_size", 256, None),  # valid
        ("rl.off_policy_steps", 2, "config.rl.off_policy_steps=2"),
        ("rollout.partial_token_budget", -5, "config.rollout.partial_token_budget=-5"),
        ("rollout.partial_segment_tokens", 0, "config.rollout.partial_segment_tokens=0"),
        ("rl.off_policy_steps", 1, "config.rl.off_policy_steps=1 trains on tokens an older policy"),
        ("rollout.partial_token_budget", 100, "config.rollout.partial_token_budget > 0 trains on tokens"),
        ("rollout.sandbox_outage_s", 0.0, "config.rollout.sandbox_outage_s=0.0: must be a positive number"),
        ("rollout.sandbox_outage_s", float("inf"), "config.rollout.sandbox_outage_s=inf"),
        ("rl.max_nonfinite_steps", 0, "config.rl.max_nonfinite_steps=0: must be a positive integer"),
        ("rollout.tools", ("python", "tests.agent.plugins:nothing"),
         "config.rollout.tools=('python', 'tests.agent.plugins:nothing'): tool 'tests.agent.plugins:"),
        ("rollout.tools", ("calc",), "config.rollout.tools=('calc',): tool 'calc': not 'python'"),
        ("rollout.tools", (), "config.rollout.tools=(): must list tools"),
        ("reward.fn", "tests.agent.plugins", "config.reward.fn='tests.agent.plugins': must be ''"),
        ("reward.fn", "tests.agent.nowhere:f", "config.reward.fn='tests.agent.nowhere:f': No module named"),
        ("reward.fn", "tests.agent.plugins:string_match", None),  # valid
    ],
)
def test_invalid_field_is_named(path, value, message):
    config = tiny_cpu.get_config()
    _set(config, path, value)
    if message is None:
        parse(config)
        return
    with pytest.raises(ConfigError) as error:
        parse(config)
    assert str(error.value).startswith(message)


def test_structural_errors():
    config = tiny_cpu.get_config()
    config.stages = [
        stage("a", steps=1, max_response_length=8, max_turns=1),
        stage("b", steps=0, max_response_length=8, max_turns=1),
    ]
    with pytest.raises(ConfigError, match=r"config\.stages\[1\]\.steps=0"):
        parse(config)
    config.stages = []
    with pytest.raises(ConfigError, match=r"config\.stages=\[\]"):
        parse(config)

    config = tiny_cpu.get_config()
    config.model.config_json = __file__  # a file that exists: the rule between the fields speaks
    with pytest.raises(ConfigError, match="config.model: set exactly one"):
        parse(config)

    config = tiny_cpu.get_config()
    config.loss.agg = "seq_mean_token_mean"
    parse(config)  # packed rows aggregate per sequence (segment), as padded ones do
    config.batch.pack = False
    config.rl.prompts_per_step = 3  # 3 x 2 = 6 rows: 2 micro-batches x 1 data shard divide them
    parse(config)
    config.num_microbatches = 4
    with pytest.raises(ConfigError, match="multiple of num_microbatches"):
        parse(config)

    config = tiny_cpu.get_config()
    config.data.source = ""
    with pytest.raises(ConfigError, match="config.data.source is empty"):
        parse(config)

    # Rollouts across an update: with the rollout correction each option is valid, the two together not.
    config = tiny_cpu.get_config()
    config.loss.old_logprobs, config.loss.rollout_is_cap = "recompute", 2.0
    config.rl.off_policy_steps = 1
    parse(config)
    config.rollout.partial_token_budget = 64
    with pytest.raises(ConfigError, match="do not combine"):
        parse(config)
    config.rl.off_policy_steps = 0
    parse(config)
    config.distributed.num_processes, config.distributed.coordinator_address = 2, "host0:12355"
    with pytest.raises(ConfigError, match="one process"):
        parse(config)


def test_fails_before_any_compute(tmp_path):
    """A bad config fails in ``parse``, before any run object exists: nothing is written."""
    config = tiny_cpu.get_config()
    config.workdir = str(tmp_path / "run")
    config.rl.keep = 0
    with pytest.raises(ConfigError, match="config.rl.keep=0"):
        parse(config)
    sft = tiny_cpu.get_config("sft")
    sft.workdir = str(tmp_path / "run")
    sft.sft.data = str(tmp_path / "missing.jsonl")
    with pytest.raises(ConfigError, match="config.sft.data="):
        parse(sft)
    parse(sft, check_data=False)  # a dry run needs no data
    assert not (tmp_path / "run").exists()


def test_missing_local_problem_files_fail_unless_dry_run(tmp_path):
    config = tiny_cpu.get_config()
    config.data.source = str(tmp_path / "rl.jsonl")
    with pytest.raises(ConfigError, match=r"^config.data.source='.*rl.jsonl': does not exist \(a local path"):
        parse(config)
    parse(config, check_data=False)  # a dry run needs no problems
    config.data.source = "org/hub_set"  # a hub name is not checked here
    parse(config)
    config.stages[1].dataset = "data/hard.parquet"
    with pytest.raises(ConfigError, match=r"^config.stages\[1\].dataset='data/hard.parquet': does not exist"):
        parse(config)
    paper = paper_qwen3_14b.get_config()  # its problem set is a placeholder path: fine for --dry_run
    parse(paper, check_data=False)
    with pytest.raises(ConfigError, match="config.data.source='data/rstar2_agent_rl_42k.jsonl': does not"):
        parse(paper)


def test_parse_names_the_kind_unknown_and_moved_fields():
    """A launcher's kind against a config of the other kind, a field the schema does not know (a config file
    may add one: ml_collections only refuses unknown command-line overrides) and a field that moved: one line
    each, naming the field; so is a config lacking a field."""
    with pytest.raises(ConfigError, match=r"^config.rl is missing: an SFT config where an RL one is needed"):
        parse(tiny_cpu.get_config("sft"), "rl")
    with pytest.raises(ConfigError, match=r"^config.sft is missing: an RL config where an SFT one"):
        parse(tiny_cpu.get_config("rl"), "sft")
    for change, message in (
        (lambda c: setattr(c.rl, "kep", 3), r"^config.rl.kep: no such field; did you mean rl.keep\?$"),
        (lambda c: setattr(c.stages[0], "turns", 3), r"^config.stages\[0\].turns: no such field"),
        (lambda c: setattr(c.loss, "temperature", 0.6),
         r"^config.loss.temperature: no such field; use rollout.temperature"),
        (lambda c: setattr(c.model.spec, "hidden_sise", 64), r"^config.model.spec.hidden_sise: not a Model"),
        (lambda c: c.rollout.__delattr__("top_k"), r"^config.rollout.top_k is missing"),
    ):
        config = tiny_cpu.get_config()
        change(config)
        with pytest.raises(ConfigError, match=message):
            parse(config)


def test_one_sampling_temperature_for_the_rollout_and_the_loss():
    config = tiny_cpu.get_config()
    config.rollout.temperature = 0.6
    options = parse(config)
    assert options.rl.rollout.sampling.temperature == options.rl.loss.temperature == 0.6


def test_stage_lengths_and_the_engine_are_derived_once(monkeypatch):
    """A stage's batch rows and engine length follow from the prompt and response budgets; the rollout
    options carry the engine of the longest stage, and ``agent.PolicyRollout`` builds a stage's engine with
    the stage's ``engine_max_len``."""
    from rstar2jax import agent

    config = tiny_cpu.get_config()  # prompts 768, responses 64 then 96: 832 and 864, whole 16-token pages
    config.batch.max_prompt_length = 770  # 770 + 64 = 834 -> 848; 770 + 96 = 866 -> 880
    options = parse(config)
    assert [(s.max_sequence_length, s.seq_len, s.engine_max_len) for s in options.stages] == [
        (834, 833, 848), (866, 865, 880)]
    assert [it.seq_len for it in options.rl.iterations] == [833, 865]
    engine = options.rl.rollout.engine
    assert engine.max_len == options.longest_stage.engine_max_len == 880 and engine.num_pages is None
    assert options.rl.rollout.kv_pool_tokens == 8 * 880  # every slot at the longest engine length
    seen = []

    def make_engine(self, params, engine_config, policy_version):
        seen.append(engine_config)
        raise InterruptedError

    monkeypatch.setattr(agent.PolicyRollout, "make_engine", make_engine)
    rollout = agent.PolicyRollout(options.model, None, None, engine_config=engine,
                                  max_prompt_length=options.rl.max_prompt_length)
    for s in options.stages:
        with pytest.raises(InterruptedError):
            rollout(None, [], samples_per_problem=4, max_response_length=s.max_response_length,
                    max_turns=1, seed=0)
    assert [e.max_len for e in seen] == [s.engine_max_len for s in options.stages]
    assert all(e == dataclasses.replace(engine, max_len=e.max_len) for e in seen)
    config.rollout.kv_cache_tokens = 4000  # whole pages: 250 of them and the null page
    assert parse(config).rl.rollout.kv_pool_tokens == 4000


def test_shipped_configs():
    paper = parse(paper_qwen3_14b.get_config(), check_data=False)  # its problems: a placeholder path
    assert (paper.rl.prompts_per_step, paper.rl.samples_per_problem, paper.rl.keep) == (512, 32, 16)
    assert [(s.max_response_length, s.steps, s.max_turns) for s in paper.stages] == [
        (8192, 300, 10),
        (12288, 85, 10),
        (12288, 125, 15),
    ]
    assert [s.reset_optimizer for s in paper.stages] == [False, False, True]
    assert paper.stages[2].hard_filter_rollouts == 8
    o = paper.optimizer
    assert (o.learning_rate, o.warmup_steps, o.weight_decay, o.max_grad_norm, o.schedule) == (
        1e-6, 20, 0.01, 1.0, "constant")
    loss = paper.rl.loss
    assert (loss.eps_low, loss.eps_high, loss.entropy_coef, loss.temperature) == (0.2, 0.28, 0.0, 1.0)
    assert paper.mesh.size == 64 and (512 * 16) % paper.row_multiple == 0
    assert paper.rl.iterations[1].seq_len == 2048 + 12288 - 1 and paper.rl.iterations[1].keep == 16
    sft = parse(paper_qwen3_14b.get_config("sft"), check_data=False)
    assert (sft.optimizer.learning_rate, sft.optimizer.schedule, sft.sft.epochs, sft.sft.batch_size) == (
        5e-6,
        "cosine",
        3,
        128,
    )
    with pytest.raises(ValueError, match="kind='eval'"):
        tiny_cpu.get_config("eval")


def _pins(options) -> dict:
    """What the run reads that a refactor must keep: the derived lengths and sizes of every part."""
    rl = options.rl
    pins = dict(model=(options.model.num_params, options.model.param_dtype, options.model.compute_dtype),
                lora=options.lora and (options.lora.rank, options.lora.alpha), rows=options.row_multiple,
                optimizer=(options.optimizer.learning_rate, options.optimizer.warmup_steps))
    if rl is not None:
        pins.update(
            seq_len=[it.seq_len for it in rl.iterations],
            engine=(rl.rollout.engine.num_slots, rl.rollout.engine.max_len, rl.rollout.kv_pool_tokens),
            selection=(rl.prompts_per_step, rl.samples_per_problem, rl.keep, rl.num_rows),
            loss=(rl.loss.old_logprobs, rl.loss.temperature, rl.loss.dual_clip),
        )
    else:
        pins.update(sft=(options.sft.batch_size, options.sft.seq_len, options.sft.steps))
    return pins


#: Every shipped config's options as they were before the config was read by one parser (the same values as
#: the old ``run_options``; the engine length then was a placeholder, 4096, and is now what the engine uses).
SHIPPED_OPTIONS = {
    (tiny_cpu, "rl"): dict(
        model=(9_798_016, "float32", "float32"), lora=None, rows=2, optimizer=(1e-4, 1), seq_len=[831, 863],
        engine=(8, 864, 6912), selection=(2, 4, 2, None), loss=("sampler", 1.0, 3.0)),
    (tiny_cpu, "sft"): dict(
        model=(9_798_016, "float32", "float32"), lora=None, rows=2, optimizer=(1e-3, -1),
        sft=(8, 1024, None)),
    (paper_qwen3_14b, "rl"): dict(
        model=(14_768_307_200, "float32", "bfloat16"), lora=None, rows=8192, optimizer=(1e-6, 20),
        seq_len=[10239, 14335, 14335], engine=(256, 14336, 256 * 14336),
        selection=(512, 32, 16, 8192), loss=("recompute", 1.0, 3.0)),
    (paper_qwen3_14b, "sft"): dict(
        model=(14_768_307_200, "float32", "bfloat16"), lora=None, rows=128, optimizer=(5e-6, -1),
        sft=(128, 8192, None)),
    (paper_qwen3_14b_lora_1gpu, "rl"): dict(
        model=(14_768_307_200, "bfloat16", "bfloat16"), lora=(16, 32.0), rows=512, optimizer=(1e-5, 20),
        seq_len=[10239, 14335, 14335], engine=(64, 14336, 256 * 1024),
        selection=(32, 32, 16, 512), loss=("recompute", 1.0, 3.0)),
    (paper_qwen3_14b_lora_1gpu, "sft"): dict(
        model=(14_768_307_200, "bfloat16", "bfloat16"), lora=(16, 32.0), rows=128, optimizer=(5e-5, -1),
        sft=(128, 8192, None)),
    (qwen3_1p7b_1gpu, None): dict(
        model=(1_720_574_976, "float32", "bfloat16"), lora=None, rows=64, optimizer=(1e-6, 20),
        seq_len=[10239], engine=(128, 10240, 256 * 1024), selection=(32, 16, 8, None),
        loss=("sampler", 1.0, 3.0)),
}


@pytest.mark.parametrize("module, kind", list(SHIPPED_OPTIONS), ids=lambda x: getattr(x, "__name__", x))
def test_every_shipped_config_parses_to_the_options_it_had(module, kind):
    config = module.get_config() if kind is None else module.get_config(kind)
    assert _pins(parse(config, check_data=False)) == SHIPPED_OPTIONS[module, kind]


#: Every shipped config with every launcher that makes sense for it: (config module, get_config argument,
#: kind the launcher trains). The demo's phases point into a demo work folder (checked without its files).
LAUNCHABLE = [
    (tiny_cpu, "rl", "rl"),  # experiments.train_rl
    (tiny_cpu, "sft", "sft"),  # experiments.sft
    (paper_qwen3_14b, "rl", "rl"),  # experiments.train_rl (--dry_run here; a cluster for real)
    (paper_qwen3_14b, "sft", "sft"),  # experiments.sft
    (paper_qwen3_14b_lora_1gpu, "rl", "rl"),  # experiments.train_rl (--dry_run here; one GPU for real)
    (paper_qwen3_14b_lora_1gpu, "sft", "sft"),  # experiments.sft
    (qwen3_1p7b_1gpu, None, "rl"),  # experiments.train_rl
    (demo, "sft", "sft"),  # experiments.sft on a demo run's files
    (demo, "rl,runs/other_demo", "rl"),  # experiments.train_rl on a demo run's files
]


@pytest.mark.parametrize("module, argument, kind", LAUNCHABLE)
def test_shipped_configs_for_every_launcher(module, argument, kind):
    config = module.get_config() if argument is None else module.get_config(argument)
    # The demo's phases are checked before the demo wrote their files, as the demo checks them.
    parse(before_files(config, demo.get_config()) if module is demo else config, kind, check_data=False)
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
    if argument is not None:
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

    model_config, params = tiny_model
    folder = tmp_path / "policy"
    models.save_pretrained(params, model_config, folder)
    config = tiny_cpu.get_config()
    config.tokenizer = ""
    config.model.path = str(folder)
    assert len(config.model.spec)  # the inline model is still there ...
    options = parse(config, check_data=False)
    loaded = options.model  # ... and the folder's model wins
    assert (loaded.vocab_size, loaded.hidden_size, loaded.num_layers) == (128, 32, 2)
    assert options.policy.tokenizer == ""  # no tokenizer in the folder: none
    train_tiny_tokenizer(["x"], 300, folder)
    assert parse(config, check_data=False).policy.tokenizer == str(folder)
    config.tokenizer = str(tmp_path / "other")
    with pytest.raises(ConfigError, match=r"^config.tokenizer='.*other': is not a folder$"):
        parse(config, check_data=False)
    (tmp_path / "other").mkdir()
    assert parse(config, check_data=False).policy.tokenizer == str(tmp_path / "other")  # an explicit one wins


def test_the_prompt_is_the_model_folders_unless_the_config_says(tmp_path, tiny_model):
    """``prompt.paper`` None (the default) prompts in the format an exported policy records
    (``save_pretrained(..., prompt=)``); a folder recording none, and no folder, give the paper's prompt;
    True / False say it in the config. A format file that does not parse fails validation, naming it."""
    from rstar2jax import models
    from rstar2jax.config.parse_model import prompt_from_config
    from rstar2jax.data.conversation import PROMPT_CONFIG_FILE, PromptConfig

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
    parse(config, check_data=False)
    config.prompt.paper = True
    assert prompt_from_config(config) == PromptConfig()
    config.prompt.paper, config.prompt.system_prompt = False, "Be brief."
    assert prompt_from_config(config) == PromptConfig(system_prompt="Be brief.", user_prefix="")
    config.prompt.paper = None
    (tmp_path / "policy" / PROMPT_CONFIG_FILE).write_text("{")
    with pytest.raises(ConfigError, match=f"config.model.path=.*{PROMPT_CONFIG_FILE}: not valid JSON"):
        parse(config, check_data=False)


def test_model_preset_field():
    from rstar2jax import models

    config = tiny_cpu.get_config()  # preset "tiny" refined by spec fields (the real Qwen3 vocabulary)
    expected = models.preset("tiny", vocab_size=151936, eos_token_ids=(151645, 151643))
    assert parse(config).model == expected
    paper = paper_qwen3_14b.get_config()
    assert parse(paper, check_data=False).model == models.preset(
        "qwen3-14b", compute_dtype="bfloat16", remat_policy="full"
    )
    config.model.preset = "qwen3-15b"
    with pytest.raises(ConfigError, match=r"config.model.preset='qwen3-15b': must be one of \('tiny'"):
        parse(config)


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
    from rstar2jax.train import StageOptions

    config = tiny_cpu.get_config()
    config.batch.pack = False
    config.data.answer_field = "solution"
    options = parse(config)
    assert options.stages[1] == StageOptions("stage2", 2, 96, 3, max_prompt_length=768, page_size=16,
                                             hard_filter_rollouts=2, reset_optimizer=True)
    assert options.total_steps == 4 and options.rl.num_rows == 2 * 2 and options.rl.prompts_per_step == 2
    assert options.data.answer_field == "solution" and options.data.problem_field is None  # '' -> guess
    assert options.checkpoint.save_every == 1 and options.logging.progress_every == 10
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.seed = 1
    assert options.sft is None and options.num_microbatches == 2 and options.row_multiple == 2
    assert options.kind == "rl" and "smoke test" in options.notice
    sft = parse(tiny_cpu.get_config("sft"))
    assert sft.stages == () and sft.rl is None and sft.data is None and sft.checkpoint.save_every == 5
    assert (sft.sft.epochs, sft.sft.batch_size, sft.sft.seq_len, sft.sft.steps) == (1, 8, 1024, None)
    assert sft.kind == "sft" and sft.optimizer.warmup_fraction == 0.04


def test_run_options_carry_the_typed_objects_the_library_reads():
    """One parse gives the trainer and the rollout engine the same model, and every typed option the run
    lifecycle, the memory plan and the rollout read; parsing touches no device."""
    from jax._src import xla_bridge

    from rstar2jax.config.options import MeshShape
    from rstar2jax.config.parse_model import policy_options
    from rstar2jax.engine import EngineConfig, SamplingParams

    config = tiny_cpu.get_config()
    config.rollout.kv_cache_tokens = 4096
    config.rollout.temperature = 0.7
    config.loss.kl_coef = 0.1
    started = dict(xla_bridge._backends)
    options = parse(config)
    assert dict(xla_bridge._backends) == started  # before prepare_process, nothing may start JAX
    assert options.model == policy_options(config).model and options.lora is None
    # num_processes "auto" (the default, issue 54): None, what the cluster's environment says at start.
    assert options.mesh == MeshShape(**config.mesh.to_dict()) and options.distributed.num_processes is None
    assert options.uses_reference and options.rl.loss.kl_coef == 0.1
    rollout = options.rl.rollout
    assert rollout.engine == EngineConfig(
        num_slots=config.rollout.engine_slots, seed=config.seed, max_len=768 + 96,
        num_pages=4096 // EngineConfig.page_size + 1,
    )
    assert rollout.sampling == SamplingParams(temperature=0.7, top_p=1.0, top_k=0)
    assert (rollout.sandbox_url, rollout.sandbox_workers) == ("", 2)
    iteration = options.rl.iterations[1]
    assert (iteration.seq_len, iteration.keep, iteration.row_multiple) == (768 + 96 - 1, 2, 2)
    assert options.optimizer.learning_rate == config.optimizer.learning_rate
    assert json.loads(options.record) == json.loads(config.to_json_best_effort())  # run_config.json


def test_every_field_has_a_check_that_refuses_its_bad_values():
    """Walks every scalar field of the RL and SFT configs (taken from the configs themselves, so a field
    added later is walked too) and sets each bad value its check declares (negative, zero where positive is
    required, an unknown choice, a missing file, a wrong type where a config can hold one): ``parse`` refuses
    each, naming the field. The launchers' side (exit 2, one line) is ``test_launchers``'."""
    for kind in ("rl", "sft"):
        cases = bad_values(tiny_cpu.get_config(kind), kind)
        assert len(cases) > (200 if kind == "rl" else 100)
        for path, value in cases:
            config = tiny_cpu.get_config(kind)
            try:
                set_path(config, path, value)
            except TypeError:  # ml_collections refuses the type already (the launcher test covers it)
                continue
            with pytest.raises(ConfigError) as error:
                parse(config, kind)
            assert str(error.value).startswith(f"config.{path}"), (path, value, str(error.value))
            assert "\n" not in str(error.value)


@pytest.mark.parametrize("kind, overrides, message", CONTRADICTIONS, ids=lambda x: str(x)[:60])
def test_values_that_contradict_another_field_are_named(kind, overrides, message):
    config = tiny_cpu.get_config(kind)
    for path, value in overrides.items():
        set_path(config, path, value)
    with pytest.raises(ConfigError) as error:
        parse(config, kind)
    assert str(error.value).startswith(message) and "\n" not in str(error.value), str(error.value)


def test_a_declared_field_the_options_do_not_carry_fails_parsing(monkeypatch):
    """A field added to the schema without a place in the typed options would be checked and then ignored:
    parsing says so instead (a field in ``RLLoopOptions`` of the same name would be filled by name)."""
    from rstar2jax.config import checks, schema_rl

    monkeypatch.setitem(schema_rl.RL, "rl.unplugged", checks.Field("sync", checks.choice(("sync",)), "x"))
    config = tiny_cpu.get_config()
    config.rl.unplugged = "sync"
    with pytest.raises(RuntimeError, match=r"parse builds no option from config.rl.unplugged"):
        parse(config)


def test_the_walk_sees_a_field_without_a_check():
    """A field a config file adds without declaring it, and a declared one whose check refuses nothing, fail
    the walk (the test above cannot pass by seeing nothing)."""
    config = tiny_cpu.get_config()
    config.rl.unplugged = "sync"
    with pytest.raises(AssertionError, match=r"config.rl.unplugged has no schema entry"):
        bad_values(config, "rl")
    from rstar2jax.config import checks, schema_rl

    lax = dataclasses.replace(schema_rl.RL["data.split"], check=checks.text())
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(schema_rl.RL, "data.split", lax)
        with pytest.raises(AssertionError, match=r"config.data.split: its check refuses nothing"):
            bad_values(tiny_cpu.get_config(), "rl")


def test_the_tools_a_run_lists_are_in_its_prompt():
    config = tiny_cpu.get_config()
    config.rollout.tools = ("python", "tests.agent.plugins:add")
    options = parse(config)
    assert options.policy.prompt.tool_names == ("execute_python_code_with_standard_io", "add")
    assert options.rl.rollout.tools == ("python", "tests.agent.plugins:add")
    assert parse(tiny_cpu.get_config()).policy.prompt == rl_prompt_default()


def rl_prompt_default():
    """The prompt of a run that lists only the Python tool: the one ``prompt.*`` gives, as before tools."""
    from rstar2jax.config.parse_model import prompt_from_config

    return prompt_from_config(tiny_cpu.get_config())
def test_option_types_bind_to_config_keys_they_state():
    """Each option type names the config key of each field it reads (``binding.key``), never by matching the
    field's name: every stated key is a schema field, a stage's keys are its fields, and a field bound to
    another key reads that key."""
    from rstar2jax.config import algorithm, loss_config, options, schema_rl
    from rstar2jax.config import parse as parse_module
    from rstar2jax.config.binding import config_keys, key
    from rstar2jax.config.schema import fields
    from rstar2jax.engine.config import SamplingParams

    known = set(fields("rl")) | set(fields("sft"))
    bound = [options.OptimizerOptions, options.DataOptions, options.CheckpointOptions, options.LoggingOptions,
             options.WandbOptions, options.MeshShape, options.DistributedOptions, options.SFTOptions,
             options.RolloutOptions, options.RLLoopOptions, algorithm.RLIterationConfig,
             loss_config.RLLossConfig]
    assert {cls.__name__: sorted(set(config_keys(cls).values()) - known) for cls in bound} == {
        cls.__name__: [] for cls in bound}
    assert set(config_keys(options.StageOptions).values()) == set(schema_rl.STAGE)
    assert config_keys(loss_config.RLLossConfig)["temperature"] == "rollout.temperature"
    assert "off_policy_correction" not in config_keys(loss_config.RLLossConfig)  # derived from rl.* by a rule
    assert set(parse_module.SAMPLING_KEYS) == {f.name for f in dataclasses.fields(SamplingParams)}

    @dataclasses.dataclass(frozen=True)
    class Renamed:
        width: int = key("mesh.fsdp", default=1)
        derived: int = 0

    assert config_keys(Renamed) == {"width": "mesh.fsdp"}
