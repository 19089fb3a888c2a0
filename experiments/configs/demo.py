"""The end-to-end CPU demo (``python -m experiments.demo``): synthetic task -> tiny tokenizer and Qwen3-shaped
model -> non-reasoning SFT on tool-use trajectories (some with a failing first call) -> two GRPO-RoC stages
(2G -> G, longer responses and more turns in the second) -> held-out evaluation before and after RL.

Sized for a CPU: a 0.6M-parameter model, two integer-task families, short sequences (~180 tokens per
trajectory). Override any field: --config.rl.optimizer.learning_rate=1e-4 --config.sft.sft.steps=100.

  python -m experiments.demo --config=experiments/configs/demo.py --config.workdir=runs/demo
"""

import dataclasses
import pathlib

import ml_collections

from rstar2jax.config.config import rl_config, sft_config, stage

# Two families whose reference code is two short lines; what a tiny model finds hard is copying the numbers
# digit by digit from the problem into the code and from the tool output into the answer.
FAMILIES = ("modpow", "lcm")


#: The demo's own fields (``--print_config``); its ``prompt``, ``sft`` and ``rl`` parts are the library's
#: (``config.field_help.FIELD_HELP``).
FIELD_HELP = {
    "task.num_train": "synthetic training problems",
    "task.num_eval": "held-out problems (disjoint from the training ones)",
    "task.families": "task families (modpow, lcm, gcd, count, digit_sum)",
    "task.difficulty": "size of the numbers in the problems",
    "sft_data.num_examples": "SFT conversations written, every tool call run in the sandbox",
    "sft_data.fail_rate": "share of conversations whose first tool call is broken, then fixed",
    "sft_data.bug_kinds": "kinds of broken first calls",
    "tokenizer_vocab_size": "vocabulary of the BPE tokenizer the demo trains",
    "tokenizer_digit_group": "numbers split into groups of up to this many digits, one token each",
    "sandbox_workers": "workers of the local code sandbox",
    "model.*": "a ModelConfig field of the demo's model over the tiny preset (vocabulary: the tokenizer's)",
    "sft": "the SFT phase's train_sft config (model, tokenizer and data filled in by the demo)",
    "rl": "the RL phase's train_rl config (policy, tokenizer and data filled in by the demo)",
    "eval.samples": "samples per held-out problem (average pass@1 over them)",
    "eval.max_response_length": "response budget of the held-out evaluation",
    "eval.max_turns": "assistant turns of the held-out evaluation",
    "lora.rank": "LoRA rank of demo.py:lora's RL phase and the LoRA arm of experiments.ablate_roc",
    "lora.alpha": "LoRA alpha (scale alpha / rank) of those runs",
    "lora.learning_rate": "RL learning rate of those runs (adapters need a higher one than all weights)",
}


def get_config(kind: str = "demo") -> ml_collections.ConfigDict:
    """``kind``: "demo" (the whole recipe: python -m experiments.demo / ablate_roc), "lora" (the same with
    the RL phase training LoRA adapters, ``c.lora``, in runs/demo_lora), or one phase of the demo for the
    training launchers, on the files a demo run wrote in its work folder (default runs/demo; another after a
    comma, e.g. ``demo.py:rl,runs/demo2``):

      python -m experiments.sft --config=experiments/configs/demo.py:sft --config.workdir=runs/demo_sft2
      python -m experiments.train_rl --config=experiments/configs/demo.py:rl --config.workdir=runs/demo_rl2
      python -m experiments.demo --config=experiments/configs/demo.py:lora

    A config is data: nothing is read here (the phases' files are checked when the launcher parses it).
    """
    kind, _, demo_workdir = kind.partition(",")
    c = _demo_config()
    c.workdir = demo_workdir or c.workdir
    if kind == "demo":
        return c
    if kind == "lora":
        c.workdir = demo_workdir or "runs/demo_lora"
        with_lora(c.rl, c.lora)
        return c
    if kind not in ("sft", "rl"):
        raise ValueError(
            f"get_config: kind={kind!r}; expected 'demo', 'lora', 'sft' or 'rl' (optionally ',WORKDIR')"
        )
    paths = DemoPaths(c.workdir)
    run = rl_run_config(c, paths) if kind == "rl" else sft_run_config(c, paths)
    run.notice = (
        f"the demo's {kind.upper()} phase on the files `python -m experiments.demo --workdir={c.workdir}` "
        "wrote (run it first)"
    )
    return run


def with_lora(rl: ml_collections.ConfigDict, lora: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The demo's RL config ``rl`` training LoRA adapters (``lora``: rank, alpha, learning_rate) of every
    projection instead of all weights; the rest of the recipe as it is."""
    rl.model.lora.rank = lora.rank
    rl.model.lora.alpha = lora.alpha
    rl.optimizer.learning_rate = lora.learning_rate
    return rl


@dataclasses.dataclass(frozen=True)
class DemoPaths:
    """Where each phase of a demo run writes, under ``workdir``."""

    workdir: pathlib.Path

    def __post_init__(self):
        object.__setattr__(self, "workdir", pathlib.Path(self.workdir))

    @property
    def train_problems(self) -> pathlib.Path:
        return self.workdir / "data" / "train.jsonl"

    @property
    def eval_problems(self) -> pathlib.Path:
        return self.workdir / "data" / "eval.jsonl"

    @property
    def sft_data(self) -> pathlib.Path:
        return self.workdir / "data" / "sft.jsonl"

    @property
    def tokenizer(self) -> pathlib.Path:
        return self.workdir / "tokenizer"

    @property
    def model_config(self) -> pathlib.Path:
        """The demo model's HF ``config.json``: the shape below with the vocabulary of the demo's tokenizer
        (written after the tokenizer is trained; the SFT phase initialises random weights of it)."""
        return self.workdir / "model" / "config.json"

    @property
    def sft_run(self) -> pathlib.Path:
        return self.workdir / "sft"

    @property
    def sft_policy(self) -> pathlib.Path:
        return self.workdir / "policies" / "sft"

    @property
    def rl_run(self) -> pathlib.Path:
        return self.workdir / "rl"

    @property
    def rl_policy(self) -> pathlib.Path:
        return self.workdir / "policies" / "rl"

    @property
    def report(self) -> pathlib.Path:
        return self.workdir / "report"

    def evaluation(self, name: str) -> pathlib.Path:
        return self.workdir / "eval" / f"{name}.json"


#: The model preset the demo's ``config.model`` fields refine.
MODEL_PRESET = "tiny"


def sft_run_config(config: ml_collections.ConfigDict, paths: DemoPaths) -> ml_collections.ConfigDict:
    """The ``train_sft`` config of the demo's SFT phase: random weights of the demo model
    (``paths.model_config``), the demo's tokenizer and SFT data, the prompt the data are written in."""
    c = ml_collections.ConfigDict(config.sft.to_dict())
    c.seed = config.seed
    c.workdir = str(paths.sft_run)
    c.tokenizer = str(paths.tokenizer)
    c.sft.data = str(paths.sft_data)
    c.prompt = ml_collections.ConfigDict(config.prompt.to_dict())  # the prompt the SFT data are written in
    c.model.config_json = str(paths.model_config)
    return c


def rl_run_config(
    config: ml_collections.ConfigDict,
    paths: DemoPaths,
    *,
    workdir: str | pathlib.Path | None = None,
    seed: int | None = None,
    roc_mode: str | None = None,
    lora: bool = False,
) -> ml_collections.ConfigDict:
    """The ``train_rl`` config of the demo's RL phase: starts from the exported SFT policy, trains on the
    train split. ``workdir`` / ``seed`` / ``roc_mode`` override the demo's (the ablation's runs); ``lora``
    trains the demo's LoRA adapters (``config.lora``) instead of all weights."""
    c = ml_collections.ConfigDict(config.rl.to_dict())
    c.seed = config.seed if seed is None else seed
    c.workdir = str(workdir or paths.rl_run)
    c.tokenizer = str(paths.tokenizer)
    c.model.path = str(paths.sft_policy)
    c.data.source = str(paths.train_problems)
    c.prompt = ml_collections.ConfigDict(config.prompt.to_dict())  # the prompt the SFT data were written in
    if roc_mode is not None:
        c.rl.roc_mode = roc_mode
    if lora:
        with_lora(c, config.lora)
    return c


def before_files(
    run: ml_collections.ConfigDict, config: ml_collections.ConfigDict
) -> ml_collections.ConfigDict:
    """A phase's run config as it can be checked before the demo wrote its files: the demo model inline
    (``MODEL_PRESET`` refined by ``config.model``, at ``config.tokenizer_vocab_size``) instead of the model
    file or the SFT policy, no tokenizer; parse it with ``check_data=False``."""
    c = ml_collections.ConfigDict(run.to_dict())
    c.tokenizer = c.model.path = c.model.config_json = ""
    c.model.preset = MODEL_PRESET
    spec = {**config.model.to_dict(), "vocab_size": config.tokenizer_vocab_size}
    c.model.spec = ml_collections.ConfigDict(spec)
    return c


def _demo_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.workdir = "runs/demo"
    c.seed = 0

    # 100 held-out problems x 4 samples: pass@1's standard error is about 2.3 points.
    c.task = ml_collections.ConfigDict(dict(num_train=2400, num_eval=100, families=FAMILIES, difficulty=1))
    # SFT conversations: a share whose first tool call is broken (a real error comes back), then fixed.
    c.sft_data = ml_collections.ConfigDict(
        dict(
            num_examples=2000,
            fail_rate=0.35,
            bug_kinds=("name_error", "syntax_error", "type_error", "missing_import"),
        )
    )
    # The paper's protocol (<reason>, Hermes <tool_call> to execute_python_code_with_standard_io,
    # <answer> with \\boxed{}) with no system text and the tool callable but not listed: the paper's full
    # prompt (paper=True) is ~390 tokens, twice a whole trajectory; SFT teaches the call format instead.
    c.prompt = rl_config().prompt  # the library's prompt section: its fields, defaults and help
    c.prompt.paper = False
    c.prompt.list_tools = False
    # Numbers in groups of up to three digits, one token each (as Llama 3 and GPT-4 split them).
    c.tokenizer_vocab_size = 2048
    c.tokenizer_digit_group = 3
    c.sandbox_workers = 2

    # The tiny preset (models.TINY: 2 Qwen3 layers, 4 heads, 2 KV heads) widened; the vocabulary comes from
    # the tokenizer the demo trains.
    c.model = ml_collections.ConfigDict(
        dict(hidden_size=128, intermediate_size=384, head_dim=32, max_position_embeddings=1024)
    )

    sft = sft_config()
    # A high rate: a tiny model learns to copy numbers (problem -> code, tool output -> answer) only after a
    # plateau, which 3e-3 does not leave within the budget.
    sft.optimizer.learning_rate = 1e-2
    sft.optimizer.warmup_steps = 10
    sft.optimizer.weight_decay = 0.0
    sft.sft.epochs = 1
    sft.sft.batch_size = 8
    sft.sft.seq_len = 384  # conversations are 120-300 tokens; 8 pack into 4 rows
    sft.sft.steps = 500
    del sft["prompt"]  # the SFT phase records the demo's prompt (above), the one its data are written in
    sft.checkpoint.save_every = 50
    c.sft = sft

    rl = rl_config()
    del rl["prompt"]  # the RL phase uses the demo's prompt (above), the one its SFT data were written in
    rl.optimizer.learning_rate = 5e-4
    rl.optimizer.warmup_steps = 1
    rl.optimizer.weight_decay = 0.0
    rl.rl.prompts_per_step = 16
    rl.rl.samples_per_problem = 8  # 2G
    rl.rl.keep = 4  # G
    rl.batch.max_prompt_length = 128
    rl.rollout.engine_slots = 64
    rl.rollout.temperature = 1.0
    rl.rollout.tool_timeout = 5.0
    rl.filter_batch_size = 16
    rl.stages = [
        stage("stage1", steps=10, max_response_length=256, max_turns=3),
        stage("stage2", steps=10, max_response_length=320, max_turns=4),
    ]
    rl.checkpoint.save_every = 4
    c.rl = rl

    # LoRA (demo.py:lora, the LoRA arm of experiments.ablate_roc): rank 8 of the 128-wide model's projections
    # (39K adapter parameters, 6.5% of the model's) at 10x the full-parameter learning rate (LoRA's usual
    # factor; its update starts from B = 0).
    c.lora = ml_collections.ConfigDict(dict(rank=8, alpha=16.0, learning_rate=5e-3))

    # Held-out evaluation: average pass@1 over k samples at the RL sampling temperature.
    c.eval = ml_collections.ConfigDict(dict(samples=4, max_response_length=320, max_turns=4))
    return c
