"""Run configuration (ml_collections): the defaults, validation that names the offending field before any
compute, and builders from a validated config to the library's typed options.

A config file (see ``experiments/configs/``) starts from ``rl_config()`` or ``sft_config()`` and overrides
fields; launchers accept ``--config.a.b=value`` on top.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rstar2jax import algo
from rstar2jax.data.conversation import PromptConfig, load_prompt_config
from rstar2jax.data.problems import looks_local
from rstar2jax.models.config import ATTENTION_IMPLEMENTATIONS, REMAT_POLICIES, SUPPORTED_DTYPES
from rstar2jax.models.lora import LORA_TARGETS
from rstar2jax.models.presets import PRESETS
from rstar2jax.train.colocate import OFFLOAD_OPTIONS
from rstar2jax.train.selection import RLIterationConfig
from rstar2jax.train.state import SCHEDULES, learning_rate_schedule, make_optimizer
from rstar2jax.train.steps import OLD_LOGPROB_SOURCES, RLLossConfig

if TYPE_CHECKING:
    import ml_collections


# ml_collections is imported where a config is built, not with this module: the library's steps, loops and
# colocation import (and its tests run) where the package is missing, e.g. a GPU image without it.
def _config_dict(fields: dict | None = None) -> ml_collections.ConfigDict:
    import ml_collections  # noqa: PLC0415

    return ml_collections.ConfigDict(fields)


def placeholder(field_type: type):
    """``ml_collections.config_dict.placeholder``: a field of that type whose value may be None."""
    import ml_collections  # noqa: PLC0415

    return ml_collections.config_dict.placeholder(field_type)


def _common() -> ml_collections.ConfigDict:
    c = _config_dict()
    c.seed = 0
    c.workdir = "runs/default"
    c.notice = ""  # printed by the launchers at start (e.g. that the config is a smoke test)
    c.model = _config_dict()
    c.model.path = ""  # HF checkpoint folder (config.json + safetensors): load_pretrained
    c.model.config_json = ""  # or an HF config.json: random init of that shape
    c.model.preset = ""  # or a named shape (models.PRESETS: "tiny", "qwen3-0.6b" ... "qwen3-14b")
    c.model.spec = _config_dict()  # or ModelConfig fields (with a preset: overrides)
    c.model.param_dtype = "float32"
    c.model.compute_dtype = "float32"
    c.model.remat_policy = "none"  # none | save_projections | save_attention | full (| dots | dots_no_batch)
    c.model.scan_layers = True
    c.model.attention = "auto"  # auto (tokamax on NVIDIA GPUs, else blockwise) | blockwise | tokamax | xla
    c.model.attention_block_size = 512  # the blockwise attention's query/key block
    c.model.mlp_chunk_size = 0  # > 0: the MLP over rematerialised token chunks of this size
    # LoRA (rank > 0): train low-rank adapters of these projections; the base weights stay frozen.
    c.model.lora = _config_dict(
        dict(rank=0, alpha=32.0, targets=LORA_TARGETS, dropout=0.0, rslora=False, dtype="float32", adapter="")
    )
    c.mesh = _config_dict(dict(data=1, fsdp=1, tensor=1))
    c.optimizer = _config_dict(
        dict(
            learning_rate=1e-6,
            warmup_steps=20,
            schedule="constant",
            total_steps=placeholder(int),
            weight_decay=0.01,
            b1=0.9,
            b2=0.999,
            eps=1e-8,
            max_grad_norm=placeholder(float),
        )
    )
    c.optimizer.max_grad_norm = 1.0
    c.num_microbatches = 1
    c.checkpoint = _config_dict(dict(save_every=10, keep=3, async_save=True))
    c.logging = _config_dict(dict(tensorboard=True, progress=True, progress_every=10))
    # Multi-host: every process gets the same config plus its own process_id (see the README).
    c.distributed = _config_dict(dict(coordinator_address="", num_processes=1, process_id=0))
    # What the policy sees around a problem (PromptConfig), recorded in every exported policy folder:
    # paper=None takes the format recorded in model.path's folder (rstar2jax_prompt.json; the paper's
    # prompt when it records none), True the paper's prompt, False the fields below. SFT data written for
    # this policy must use the same prompt (the demo copies its own prompt here).
    c.prompt = _config_dict(dict(paper=placeholder(bool), system_prompt="", user_prefix="", list_tools=True))
    return c


def rl_config() -> ml_collections.ConfigDict:
    """GRPO-RoC defaults (the paper's where it gives them); stages are added by the config file."""
    c = _common()
    c.tokenizer = ""
    c.data = _config_dict(
        dict(
            source="",
            split="train",
            problem_field="",
            answer_field="",
            solution_field="",
            id_field="",
            integer_only=False,
            limit=placeholder(int),
        )
    )
    c.loss = _config_dict(
        dict(
            eps_low=0.2,
            eps_high=0.28,
            dual_clip=placeholder(float),
            agg="token_mean",
            entropy_coef=0.0,
            temperature=1.0,
            old_logprobs="sampler",
            # GSPO: "sequence" (its own clip range below); "token" is PPO/GRPO.
            importance_sampling_level="token",
            gspo_eps_low=3e-4,
            gspo_eps_high=4e-4,
            # KL to a frozen reference policy (the initial params); off in the paper.
            kl_coef=0.0,
            kl="k3",
            # Rollout correction (needs old_logprobs="recompute"): token TIS cap C, sequence mask
            # ("sequence" / "geometric" ratio) outside [1/C', C'].
            rollout_is_cap=placeholder(float),
            rollout_mask=placeholder(str),
            rollout_mask_threshold=2.0,
        )
    )
    c.loss.dual_clip = 3.0  # verl's clip_ratio_c and the released code; None turns it off
    c.rl = _config_dict(
        dict(
            prompts_per_step=512,
            samples_per_problem=32,
            keep=16,
            roc_mode="paper",
            min_negatives=2,
            min_positives=2,
            reject_equal_reward=True,
            roc_eps=1e-6,
            estimator="grpo",
            std="unbiased",
            advantage_eps=1e-6,
            # "paper" (Eq. 5) or "release" (the released code's answer-format rule) for RoC's p_format.
            format_penalty="paper",
            # Truncated responses: drop them from the loss (TRL's mask_truncated_completions) and/or DAPO's
            # soft overlong penalty over the last overlong_buffer tokens of the budget (0 = off).
            mask_truncated=False,
            overlong_buffer=0,
            overlong_penalty_factor=1.0,
            # 1: step n+1's rollout is generated with step n's parameters before step n's update (one-step
            # off-policy; needs the rollout correction below). 0: synchronous on-policy.
            off_policy_steps=0,
            # A step with a non-finite loss or gradient skips its update; this many in a row stop the run.
            max_nonfinite_steps=3,
        )
    )
    c.batch = _config_dict(dict(max_prompt_length=1024, pack=True))
    c.rollout = _config_dict(
        dict(
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_tool_calls_per_turn=1,
            tool_timeout=10.0,
            tool_output_chars=2048,
            sandbox_url="",
            sandbox_workers=2,
            sandbox_outage_s=300.0,  # how long tool calls wait for a sandbox that does not answer
            engine_slots=64,
            kv_cache_tokens=0,  # tokens the engine's KV pool holds; 0: engine_slots x the longest sequence
            # Partial rollouts: > 0 stops a step's rollouts once they sampled this many tokens; finished
            # groups are trained on, unfinished rollouts resume next step (needs the rollout correction).
            partial_token_budget=0,
            partial_segment_tokens=64,  # tokens sampled between looks at that budget
        )
    )
    # Colocated rollout and training (rstar2jax.train.colocate): where the optimizer moments wait while the
    # engine runs ("host": pinned host memory; "auto": host on accelerators, device on the CPU backend). The
    # engine's KV page pool exists only during rollout (each rollout builds it; it is freed when it ends).
    c.colocate = _config_dict(dict(optimizer_memory="auto"))
    # Per-device memory for the start-up memory plan check; None: what the device reports (none on CPU).
    c.device_memory_gib = placeholder(float)
    c.filter_batch_size = 64
    c.stages = []
    return c


def stage(
    name: str,
    *,
    steps: int,
    max_response_length: int,
    max_turns: int,
    dataset: str = "",
    hard_filter_rollouts: int = 0,
    reset_optimizer: bool = False,
) -> ml_collections.ConfigDict:
    """One RL stage. ``dataset`` empty: the previous stage's problems (the first stage: ``config.data``);
    ``hard_filter_rollouts`` k > 0: at the stage start drop problems the current policy solves k/k."""
    return _config_dict(
        dict(
            name=name,
            steps=steps,
            max_response_length=max_response_length,
            max_turns=max_turns,
            dataset=dataset,
            hard_filter_rollouts=hard_filter_rollouts,
            reset_optimizer=reset_optimizer,
        )
    )


def sft_config() -> ml_collections.ConfigDict:
    """Non-reasoning SFT defaults (paper: 3 epochs, lr 5e-6, 4% warm-up, cosine, batch 128)."""
    c = _common()
    c.tokenizer = ""
    c.optimizer.learning_rate = 5e-6
    c.optimizer.schedule = "cosine"
    c.optimizer.warmup_steps = -1  # -1: warmup_fraction of the total steps
    c.sft = _config_dict(
        dict(data="", epochs=3, batch_size=128, seq_len=4096, warmup_fraction=0.04, steps=placeholder(int))
    )
    return c


#: What each config field means (``--print_config`` lists them; a test keeps this complete). Stage fields are
#: under ``stages.*``, inline model fields under ``model.spec.*``.
FIELD_HELP = {
    "seed": "seed of the initial weights, data order and sampling",
    "notice": "a line the launchers print at start (e.g. that the config is only a smoke test)",
    "workdir": "the run's folder: checkpoints/, metrics.jsonl, tensorboard/; a rerun resumes from it",
    "tokenizer": "tokenizer folder (HF format, with its chat template); empty: model.path's own tokenizer, "
    "else pre-tokenised SFT data only",
    "model.path": "HF checkpoint folder (config.json + safetensors) to start from; wins over the ones below",
    "model.config_json": "or an HF config.json, or a preset name: random weights of that shape",
    "model.preset": "or a named model shape (models.PRESETS), refined by model.spec fields: random weights",
    "model.spec": "or inline ModelConfig fields (model_type, hidden_size, ...): random weights",
    "model.spec.*": "a ModelConfig field of the inline model",
    "model.param_dtype": "dtype of the master weights and optimizer moments",
    "model.compute_dtype": "dtype of activations and matmuls",
    "model.remat_policy": "activation rematerialisation: none / full / ... (memory for compute)",
    "model.scan_layers": "scan over stacked layers (faster compiles) instead of unrolling them",
    "model.attention": "training attention: auto (tokamax on NVIDIA GPUs, else blockwise) / blockwise / "
    "tokamax / xla",
    "model.attention_block_size": "query/key block of the blockwise attention (a multiple of 8)",
    "model.mlp_chunk_size": "> 0: the MLP over rematerialised token chunks of this size (0: whole sequence)",
    "model.lora.rank": "LoRA rank r (0: off, full fine-tuning); > 0 trains adapters, the base stays frozen",
    "model.lora.alpha": "LoRA scale numerator: the adapters' path is multiplied by alpha / rank",
    "model.lora.targets": f"projections that get adapters (any of {LORA_TARGETS})",
    "model.lora.dropout": "dropout on the adapters' input (SFT only; RL needs a deterministic policy)",
    "model.lora.rslora": "rank-stabilised scale alpha / sqrt(rank) (PEFT's use_rslora)",
    "model.lora.dtype": "dtype of the adapters and their optimizer moments (the base: model.param_dtype)",
    "model.lora.adapter": "a PEFT adapter folder to start from (continue training); empty: fresh adapters",
    "mesh.data": "data-parallel mesh axis size",
    "mesh.fsdp": "fully-sharded data-parallel axis size (weights and optimizer sharded)",
    "mesh.tensor": "tensor-parallel axis size (heads and MLP split); data x fsdp x tensor = devices",
    "optimizer.learning_rate": "AdamW peak learning rate",
    "optimizer.warmup_steps": "linear warm-up steps (-1 in SFT: sft.warmup_fraction of the run)",
    "optimizer.schedule": "after warm-up: constant or cosine decay",
    "optimizer.total_steps": "steps the schedule spans (None: the run's length)",
    "optimizer.weight_decay": "AdamW decoupled weight decay",
    "optimizer.b1": "AdamW beta1",
    "optimizer.b2": "AdamW beta2",
    "optimizer.eps": "AdamW epsilon",
    "optimizer.max_grad_norm": "global gradient-norm clip (None: no clipping)",
    "num_microbatches": "gradient accumulation: each step's batch in this many sequential micro-batches",
    "checkpoint.save_every": "save a checkpoint every this many steps (and at the end, and on Ctrl-C)",
    "checkpoint.keep": "how many of the latest checkpoints to keep",
    "checkpoint.async_save": "write checkpoints in a background thread",
    "logging.tensorboard": "also write TensorBoard events to <workdir>/tensorboard",
    "logging.progress": "show progress (a bar on a terminal, else one line every progress_every steps)",
    "logging.progress_every": "steps between progress lines when the output is not a terminal",
    "distributed.coordinator_address": "multi-host: HOST:PORT of process 0 (empty: one process)",
    "distributed.num_processes": "multi-host: number of processes (hosts)",
    "distributed.process_id": "multi-host: this process's index, 0 .. num_processes - 1",
    "data.source": "RL problems: a .jsonl/.json/.parquet file, a datasets folder or a hub name",
    "data.split": "split to read from dataset dicts and hub datasets",
    "data.problem_field": "column of the problem text (empty: problem / question / prompt)",
    "data.answer_field": "column of the gold answer, dotted for nested (empty: answer / ... / "
    "reward_model.ground_truth)",
    "data.solution_field": "column of a worked solution whose last \\boxed{} is the answer (empty: solution)",
    "data.id_field": "column of the problem id (empty: id / unique_id / ...; else the row index)",
    "data.integer_only": "keep only problems with integer answers (rejected rows are counted and shown)",
    "data.limit": "use at most this many problems (None: all)",
    "prompt.paper": "None: the format recorded in model.path's folder (else the paper's); True: the paper's "
    "prompt (system text, the tool schema listed); False: the fields below",
    "prompt.system_prompt": "system text when prompt.paper is False",
    "prompt.user_prefix": "text put before each problem when prompt.paper is False",
    "prompt.list_tools": "list the Python tool's schema in the prompt when prompt.paper is False",
    "loss.eps_low": "PPO clip range below 1 (ratio >= 1 - eps_low)",
    "loss.eps_high": "PPO clip range above 1 (clip-higher: ratio <= 1 + eps_high)",
    "loss.dual_clip": "dual-clip bound c > 1 for negative advantages (default 3 as verl; None: off)",
    "loss.agg": "loss aggregation: token_mean (paper), per-sequence means, verl / Dr. GRPO sum-norm",
    "loss.entropy_coef": "entropy bonus coefficient (paper: 0)",
    "loss.temperature": "sampling temperature the trainer divides logits by (match rollout.temperature)",
    "loss.old_logprobs": "pi_old from the sampler's log-probs or recomputed by the trainer",
    "loss.importance_sampling_level": "ratio per token (PPO/GRPO) or per sequence (GSPO, geometric mean)",
    "loss.gspo_eps_low": "GSPO clip range below 1 (used when importance_sampling_level = sequence)",
    "loss.gspo_eps_high": "GSPO clip range above 1 (used when importance_sampling_level = sequence)",
    "loss.kl_coef": "KL penalty to a frozen copy of the initial policy (paper: 0, no reference kept)",
    "loss.kl": "KL estimator: k1 / k2 / k3, + for the straight-through gradient of k2",
    "loss.rollout_is_cap": "rollout correction: cap C of token weights pi_train / pi_rollout (None: off)",
    "loss.rollout_mask": "rollout correction: drop sequences whose (geometric) ratio leaves [1/C', C']",
    "loss.rollout_mask_threshold": "rollout correction: C' of rollout_mask",
    "rl.prompts_per_step": "problems per RL step",
    "rl.samples_per_problem": "rollouts sampled per problem (2G)",
    "rl.keep": "rollouts kept per problem by Resample-on-Correct (G)",
    "rl.roc_mode": "RoC down-sampling: paper (fewest tool errors among correct) or uniform (plain GRPO)",
    "rl.min_negatives": "RoC keeps at least this many incorrect rollouts when available",
    "rl.min_positives": "RoC keeps at least this many correct rollouts when available",
    "rl.reject_equal_reward": "drop groups whose kept rollouts all have the same reward",
    "rl.roc_eps": "tie-breaking epsilon of the RoC penalty ordering",
    "rl.estimator": "advantage estimator (grpo: group-normalised reward)",
    "rl.std": "group std: unbiased (Bessel) or biased",
    "rl.advantage_eps": "added to the group std before dividing",
    "rl.format_penalty": "RoC answer-format penalty: paper (Eq. 5) or release (the released code's rule)",
    "rl.mask_truncated": "truncated responses carry no loss (they still count in their group's advantages)",
    "rl.overlong_buffer": "DAPO soft overlong penalty over the last N tokens of the budget (0: off)",
    "rl.overlong_penalty_factor": "DAPO soft overlong penalty at the budget (reward - factor)",
    "rl.off_policy_steps": "1: roll out step n+1 with step n's parameters before step n's update (one-step "
    "off-policy, needs loss.old_logprobs='recompute' and a rollout correction); 0: on-policy",
    "rl.max_nonfinite_steps": "a step with a non-finite loss or gradient skips its update; this many in a "
    "row stop the run (exit 3, the last checkpoint kept)",
    "batch.max_prompt_length": "longest prompt in tokens (longer problems are rejected)",
    "batch.pack": "pack several trajectories per row; False: one per row (worst case must fit)",
    "rollout.temperature": "sampling temperature of rollouts",
    "rollout.top_p": "nucleus sampling (1: off)",
    "rollout.top_k": "top-k sampling (0: off)",
    "rollout.max_tool_calls_per_turn": "tool calls run per assistant turn",
    "rollout.tool_timeout": "seconds a tool call may run",
    "rollout.tool_output_chars": "tool output kept per call (characters)",
    "rollout.sandbox_url": "code sandbox URL (empty: start a local one for the run)",
    "rollout.sandbox_workers": "workers of the local sandbox",
    "rollout.sandbox_outage_s": "seconds tool calls wait (retrying with back-off) for a sandbox that does "
    "not answer; past it the run stops (exit 3) keeping the last finished step's checkpoint",
    "rollout.engine_slots": "concurrent sequences in the generation engine",
    "rollout.kv_cache_tokens": "tokens the KV page pool holds (0: engine_slots x the longest sequence)",
    "rollout.partial_token_budget": "partial rollouts: > 0 stops a step's rollouts after this many sampled "
    "tokens, trains on the finished groups and resumes the rest next step (0: off; needs the rollout "
    "correction)",
    "rollout.partial_segment_tokens": "partial rollouts: tokens a session samples between budget checks",
    "colocate.optimizer_memory": "where optimizer moments wait during rollout: auto / host (pinned) / device",
    "device_memory_gib": "per-device memory the plan is checked against (None: what the device reports)",
    "filter_batch_size": "problems per batch of the hard-problem filter's rollouts",
    "stages": "the RL stages, run in order",
    "stages.name": "stage name (in logs and checkpoints)",
    "stages.steps": "RL steps of the stage",
    "stages.max_response_length": "response budget in tokens (all turns and tool outputs)",
    "stages.max_turns": "assistant turns per rollout",
    "stages.dataset": "the stage's problems (empty: the previous stage's, the first: data.source)",
    "stages.hard_filter_rollouts": "k > 0: at the stage start drop problems the policy solves k/k",
    "stages.reset_optimizer": "fresh optimizer moments and schedule at the stage start",
    "sft.data": "SFT data: JSONL of chats (messages, tools) or pre-tokenised input_ids + loss_mask",
    "sft.epochs": "passes over the SFT data",
    "sft.batch_size": "SFT examples per step (packed into rows of sft.seq_len)",
    "sft.seq_len": "packed row length in tokens",
    "sft.warmup_fraction": "warm-up share of the run when optimizer.warmup_steps is -1",
    "sft.steps": "SFT steps (None: epochs x examples / batch_size)",
}


def field_help(path: str, extra: dict[str, str] | None = None) -> str | None:
    """The meaning of config field ``path`` (``stages[2].steps`` reads ``stages.steps``), looked up in
    ``extra`` first, then in ``FIELD_HELP`` with leading components dropped until one matches (a demo
    config's ``rl.rl.keep`` is ``rl.keep``); ``a.*`` entries cover every field under ``a``. None when no
    table knows it."""
    parts = re.sub(r"\[\d+\]", "", path).split(".")
    for table, starts in ((extra or {}, 1), (FIELD_HELP, len(parts))):
        for start in range(starts):
            if (name := ".".join(parts[start:])) in table:
                return table[name]
            for end in range(len(parts) - 1, start, -1):  # "model.spec.*" covers model.spec.hidden_size
                if (group := ".".join(parts[start:end]) + ".*") in table:
                    return table[group]
    return None


class ConfigError(ValueError):
    """An invalid config field; the message starts with the field's full name."""


def _field(config, path: str) -> Any:
    value = config
    for part in path.split("."):
        if part not in value:
            raise ConfigError(f"config.{path} is missing")
        value = value[part]
    return value


def _check(config, path: str, ok: Callable[[Any], bool], expectation: str) -> Any:
    value = _field(config, path)
    try:
        good = ok(value)
    except TypeError:
        good = False
    if not good:
        raise ConfigError(f"config.{path}={value!r}: {expectation}")
    return value


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _positive_int(config, path):
    return _check(config, path, lambda v: _is_int(v) and v > 0, "must be a positive integer")


def _one_of(config, path, options):
    return _check(config, path, lambda v: v in options, f"must be one of {tuple(options)}")


def _validate_common(config, *, warmup_may_be_auto: bool = False, check_paths: bool = True) -> None:
    _check(config, "seed", _is_int, "must be an integer")
    _check(config, "workdir", lambda v: isinstance(v, str) and v, "must be a non-empty path")
    # model.path wins over the others: a command line cannot clear a config's inline spec, and
    # --config.model.path=<an exported policy> must start the run from that policy.
    if not _field(config, "model.path"):
        sources = [name for name in ("config_json", "preset") if _field(config, f"model.{name}")]
        if len(_field(config, "model.spec")) and sources != ["preset"]:  # spec fields override a preset's
            sources += ["spec"]
        if len(sources) != 1:
            raise ConfigError(
                f"config.model: set exactly one of config_json / preset / spec (spec may refine a preset; "
                f"model.path wins over all of them), got {sources or 'none'}"
            )
    _check(config, "model.preset", lambda v: not v or v in PRESETS, f"must be one of {PRESETS}")
    for name in ("path", "config_json") if check_paths else ():
        _check(config, f"model.{name}", lambda v: not v or os.path.exists(v), "does not exist")
    if check_paths:
        _check(config, "tokenizer", lambda v: not v or os.path.isdir(v), "is not a tokenizer folder")
    if "prompt" in config:
        _check(config, "prompt.paper", lambda v: v in (None, True, False), "must be None, True or False")
        if check_paths:
            try:
                prompt_from_config(config)
            except ValueError as error:  # the format file of model.path does not parse
                raise ConfigError(f"config.model.path={config.model.path!r}: {error}") from None
    for name in ("param_dtype", "compute_dtype"):
        _one_of(config, f"model.{name}", SUPPORTED_DTYPES)
    _one_of(config, "model.remat_policy", REMAT_POLICIES)
    _one_of(config, "model.attention", ATTENTION_IMPLEMENTATIONS)
    _check(
        config, "model.attention_block_size", lambda v: v > 0 and v % 8 == 0, "must be a multiple of 8 (> 0)"
    )
    _check(config, "model.mlp_chunk_size", lambda v: v >= 0, "must be >= 0")
    _validate_lora(config, check_paths=check_paths)
    for axis in ("data", "fsdp", "tensor"):
        _positive_int(config, f"mesh.{axis}")
    _check(config, "optimizer.learning_rate", lambda v: v > 0, "must be positive")
    low = -1 if warmup_may_be_auto else 0
    _check(
        config, "optimizer.warmup_steps", lambda v: _is_int(v) and v >= low, f"must be an integer >= {low}"
    )
    _one_of(config, "optimizer.schedule", SCHEDULES)
    _check(config, "optimizer.weight_decay", lambda v: v >= 0, "must be >= 0")
    _check(config, "optimizer.max_grad_norm", lambda v: v is None or v > 0, "must be positive or None")
    _positive_int(config, "num_microbatches")
    _positive_int(config, "checkpoint.save_every")
    _positive_int(config, "checkpoint.keep")
    _positive_int(config, "logging.progress_every")
    _positive_int(config, "distributed.num_processes")
    _check(
        config,
        "distributed.process_id",
        lambda v: 0 <= v < config.distributed.num_processes,
        "must be in [0, distributed.num_processes)",
    )


def _validate_lora(config, *, check_paths: bool) -> None:
    """``config.model.lora``'s own values (checks against the model's shapes: ``train.lora``)."""
    if "lora" not in config.model:  # a config written before LoRA existed
        return
    rank = _check(
        config, "model.lora.rank", lambda v: _is_int(v) and v >= 0, "must be an integer >= 0 (0: off)"
    )
    if not rank:
        return
    targets = _check(config, "model.lora.targets", lambda v: isinstance(v, list | tuple) and len(v) > 0,
                     f"must list projections (any of {LORA_TARGETS})")
    for target in targets:
        if target not in LORA_TARGETS:
            raise ConfigError(f"config.model.lora.targets: {target!r} is not a projection of the model; "
                              f"expected any of {LORA_TARGETS}")
    _check(config, "model.lora.alpha", lambda v: v > 0, "must be positive")
    _check(config, "model.lora.dropout", lambda v: 0 <= v < 1, "must be in [0, 1)")
    _one_of(config, "model.lora.dtype", SUPPORTED_DTYPES)
    if check_paths:
        _check(config, "model.lora.adapter", lambda v: not v or os.path.isdir(v), "is not a folder")


def lora_enabled(config) -> bool:
    """Whether the run trains LoRA adapters (``config.model.lora.rank`` > 0) instead of all weights."""
    return bool(config.model.get("lora") and config.model.lora.rank)


def row_multiple(config) -> int:
    """Batch rows must split into micro-batches whose rows split over the data-parallel devices."""
    return config.num_microbatches * config.mesh.data * config.mesh.fsdp


def validate_rl_config(config, *, check_data: bool = True, check_paths: bool = True) -> None:
    """Raises ``ConfigError`` naming the first invalid field; runs before any model is built
    (``check_data=False``: dry runs need no problem set; ``check_paths=False``: no file need exist yet)."""
    _validate_common(config, check_paths=check_paths)
    _one_of(config, "loss.agg", algo.AGG_MODES)
    _check(config, "loss.eps_low", lambda v: 0 < v < 1, "must be in (0, 1)")
    _check(config, "loss.eps_high", lambda v: v > 0, "must be positive")
    _check(config, "loss.dual_clip", lambda v: v is None or v > 1, "must be None or > 1")
    _check(config, "loss.entropy_coef", lambda v: v >= 0, "must be >= 0")
    _check(config, "loss.temperature", lambda v: v > 0, "must be positive")
    _one_of(config, "loss.old_logprobs", OLD_LOGPROB_SOURCES)
    _one_of(config, "loss.importance_sampling_level", algo.IS_LEVELS)
    _check(config, "loss.gspo_eps_low", lambda v: 0 < v < 1, "must be in (0, 1)")
    _check(config, "loss.gspo_eps_high", lambda v: v > 0, "must be positive")
    _check(config, "loss.kl_coef", lambda v: v >= 0, "must be >= 0")
    _one_of(config, "loss.kl", algo.KL_ESTIMATORS)
    _check(config, "loss.rollout_is_cap", lambda v: v is None or v > 1, "must be None or > 1")
    _check(config, "loss.rollout_mask", lambda v: v is None or v in algo.SEQUENCE_RATIOS,
           f"must be None or one of {algo.SEQUENCE_RATIOS}")
    _check(config, "loss.rollout_mask_threshold", lambda v: v > 1, "must be > 1")
    if lora_enabled(config) and config.model.lora.dropout:
        raise ConfigError(
            f"config.model.lora.dropout={config.model.lora.dropout}: must be 0 in RL (a random policy makes "
            "the importance ratio pi / pi_old noise); dropout is for SFT"
        )
    if (config.loss.rollout_is_cap is not None or config.loss.rollout_mask is not None) and (
        config.loss.old_logprobs != "recompute"
    ):
        raise ConfigError(
            "config.loss.rollout_is_cap / loss.rollout_mask: rollout correction compares the trainer's "
            "log-probs with the sampler's; set loss.old_logprobs='recompute'"
        )
    _positive_int(config, "rl.prompts_per_step")
    samples = _check(
        config, "rl.samples_per_problem", lambda v: _is_int(v) and v >= 2, "must be an integer >= 2"
    )
    _check(
        config,
        "rl.keep",
        lambda v: _is_int(v) and 1 <= v <= samples,
        f"must be an integer in [1, rl.samples_per_problem={samples}]",
    )
    _one_of(config, "rl.roc_mode", algo.ROC_MODES)
    _one_of(config, "rl.estimator", algo.ADVANTAGE_ESTIMATORS)
    _one_of(config, "rl.std", algo.STD_MODES)
    _check(config, "rl.roc_eps", lambda v: v > 0, "must be positive")
    _one_of(config, "rl.format_penalty", algo.FORMAT_PENALTIES)
    _check(config, "rl.mask_truncated", lambda v: isinstance(v, bool), "must be True or False")
    _check(config, "rl.overlong_buffer", lambda v: _is_int(v) and v >= 0, "must be an integer >= 0")
    _check(config, "rl.overlong_penalty_factor", lambda v: v >= 0, "must be >= 0")
    _positive_int(config, "batch.max_prompt_length")
    if not config.batch.pack:
        rows, multiple = config.rl.prompts_per_step * config.rl.keep, row_multiple(config)
        if rows % multiple:
            raise ConfigError(
                f"config.rl.prompts_per_step x rl.keep = {rows} rows must be a multiple of "
                f"num_microbatches x mesh.data x mesh.fsdp = {multiple} when batch.pack=False"
            )
    _check(config, "stages", lambda v: len(v) > 0, "must list at least one stage")
    for i, s in enumerate(config.stages):
        for name in ("steps", "max_response_length", "max_turns"):
            _check_stage_int(config, i, name)
        if config.rl.overlong_buffer > s.max_response_length:
            raise ConfigError(
                f"config.rl.overlong_buffer={config.rl.overlong_buffer} is longer than "
                f"stages[{i}].max_response_length={s.max_response_length}"
            )
        if s.hard_filter_rollouts < 0:
            raise ConfigError(
                f"config.stages[{i}].hard_filter_rollouts={s.hard_filter_rollouts}: must be >= 0"
            )
    if not config.data.source and not config.stages[0].dataset:
        raise ConfigError("config.data.source is empty and config.stages[0].dataset names no dataset")
    if check_data and check_paths:  # a local problem file that is not there fails now, not at its stage
        missing = "does not exist (a local path; hub dataset names are 'name' or 'org/name')"
        _check(config, "data.source", lambda v: not v or os.path.exists(v) or not looks_local(v), missing)
        for i, s in enumerate(config.stages):
            if s.dataset and not os.path.exists(s.dataset) and looks_local(s.dataset):
                raise ConfigError(f"config.stages[{i}].dataset={s.dataset!r}: {missing}")
    _positive_int(config, "filter_batch_size")
    _positive_int(config, "rl.max_nonfinite_steps")
    _check(
        config,
        "rollout.sandbox_outage_s",
        lambda v: not isinstance(v, bool) and v > 0 and math.isfinite(v),
        "must be a positive number of seconds",
    )
    _check(config, "rollout.kv_cache_tokens", lambda v: _is_int(v) and v >= 0, "must be an integer >= 0")
    _check_rollouts_across_updates(config)
    _one_of(config, "colocate.optimizer_memory", OFFLOAD_OPTIONS)
    _check(config, "device_memory_gib", lambda v: v is None or v > 0, "must be positive or None")


def _check_rollouts_across_updates(config) -> None:
    """One-step off-policy and partial rollouts: valid values, not both, and the rollout correction on."""
    off = _one_of(config, "rl.off_policy_steps", (0, 1))
    budget = _check(
        config, "rollout.partial_token_budget", lambda v: _is_int(v) and v >= 0, "must be an integer >= 0"
    )
    _positive_int(config, "rollout.partial_segment_tokens")
    if off and budget:
        raise ConfigError(
            "config.rl.off_policy_steps=1 and config.rollout.partial_token_budget > 0 do not combine: "
            "pick one way for rollouts to cross a policy update"
        )
    if not (off or budget):
        return
    option = "config.rl.off_policy_steps=1" if off else "config.rollout.partial_token_budget > 0"
    if config.loss.old_logprobs != "recompute" or (
        config.loss.rollout_is_cap is None and config.loss.rollout_mask is None
    ):
        raise ConfigError(
            f"{option} trains on tokens an older policy sampled: it needs the rollout correction, "
            "loss.old_logprobs='recompute' with loss.rollout_is_cap and/or loss.rollout_mask set"
        )
    if budget and config.distributed.num_processes > 1:
        raise ConfigError(f"{option}: partial rollouts run in one process (distributed.num_processes=1)")


def _check_stage_int(config, index: int, name: str) -> None:
    value = config.stages[index][name] if name in config.stages[index] else None
    if not _is_int(value) or value <= 0:
        raise ConfigError(f"config.stages[{index}].{name}={value!r}: must be a positive integer")


def validate_sft_config(config, *, check_data: bool = True, check_paths: bool = True) -> None:
    """Raises ``ConfigError`` naming the first invalid field (``check_data=False``: dry runs need no data;
    ``check_paths=False``: neither data nor the model and tokenizer folders need to exist yet)."""
    _validate_common(config, warmup_may_be_auto=True, check_paths=check_paths)
    if check_data and check_paths:
        _check(config, "sft.data", lambda v: isinstance(v, str) and os.path.exists(v), "does not exist")
    _positive_int(config, "sft.epochs")
    _positive_int(config, "sft.batch_size")
    _positive_int(config, "sft.seq_len")
    _check(config, "sft.warmup_fraction", lambda v: 0 <= v < 1, "must be in [0, 1)")
    _check(config, "sft.steps", lambda v: v is None or (_is_int(v) and v > 0), "must be None or positive")


#: Configs ``validate`` accepted, by content, with how much of them was checked: a run's config is checked
#: once, however many entry points (launcher, ``train_rl`` / ``train_sft``, ``dry_run``) it passes through.
_ACCEPTED: dict[tuple[str, str], tuple[bool, bool]] = {}
KINDS = ("rl", "sft")


def prompt_from_config(config) -> PromptConfig:
    """The conversation format of a run (``config.prompt``): ``paper`` None takes the one recorded in
    ``config.model.path``'s folder (an exported policy records it), else the paper's prompt; True the paper's
    (system text and the listed tool schema); False ``config.prompt``'s system prompt, user prefix and
    ``list_tools`` with the paper's Python tool and opener. SFT data and rollouts must use the same prompt.
    A run config without a ``prompt`` section (an SFT run of an older version) gives the paper's."""
    p = config.get("prompt")
    if p is None or p.paper:
        return PromptConfig()
    if p.paper is None:
        path = config.model.get("path", "")
        return (load_prompt_config(path) if path and os.path.isdir(path) else None) or PromptConfig()
    return PromptConfig(system_prompt=p.system_prompt, user_prefix=p.user_prefix, list_tools=p.list_tools)


def tokenizer_path(config) -> str:
    """The run's tokenizer folder: ``config.tokenizer``, else ``config.model.path`` when that folder holds a
    tokenizer (an exported policy does), else '' (none)."""
    if config.tokenizer:
        return config.tokenizer
    path = config.model.get("path", "")
    has_tokenizer = path and any(
        os.path.exists(os.path.join(path, name)) for name in ("tokenizer.json", "tokenizer_config.json")
    )
    return path if has_tokenizer else ""


def validate(config, kind: str, *, check_data: bool = True, check_paths: bool = True) -> None:
    """The one config check of a run: raises ``ConfigError`` naming the first invalid field, its value and
    what is allowed, before any compute. ``kind`` is "rl" or "sft"; ``check_data=False`` (dry runs) skips
    the existence of SFT data, ``check_paths=False`` also that of the model and tokenizer folders (a recipe
    checking a later phase's config before an earlier phase writes them). A config whose content passed an
    equal or stricter check before is not checked again, so launchers and the library entry points they
    call share one check."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}; expected one of {KINDS}")
    key = (kind, config.to_json_best_effort(sort_keys=True))
    wanted = (check_paths, check_data and check_paths)
    done = _ACCEPTED.get(key)
    if done is not None and all(d >= w for d, w in zip(done, wanted, strict=True)):
        return
    if kind == "rl":
        validate_rl_config(config, check_data=check_data, check_paths=check_paths)
    else:
        validate_sft_config(config, check_data=check_data, check_paths=check_paths)
    if len(_ACCEPTED) > 64:
        _ACCEPTED.clear()
    _ACCEPTED[key] = tuple(max(d, w) for d, w in zip(done or (False, False), wanted, strict=True))


def _schedule_options(config, total_steps: int | None) -> dict[str, Any]:
    o = config.optimizer
    total = o.total_steps or total_steps
    warmup = o.warmup_steps if o.warmup_steps >= 0 else math.ceil(config.sft.warmup_fraction * total)
    return dict(warmup_steps=warmup, schedule=o.schedule, total_steps=total)


def build_schedule(config, total_steps: int | None = None):
    """The learning-rate schedule of ``config.optimizer`` (what ``build_optimizer`` applies)."""
    return learning_rate_schedule(config.optimizer.learning_rate, **_schedule_options(config, total_steps))


def build_optimizer(config, total_steps: int | None = None):
    """The optimizer of ``config.optimizer`` (``warmup_steps=-1``: ``sft.warmup_fraction`` of the run)."""
    o = config.optimizer
    return make_optimizer(
        o.learning_rate,
        **_schedule_options(config, total_steps),
        weight_decay=o.weight_decay,
        b1=o.b1,
        b2=o.b2,
        eps=o.eps,
        max_grad_norm=o.max_grad_norm,
    )


def build_loss_config(config) -> RLLossConfig:
    return RLLossConfig(**config.loss.to_dict())


def uses_reference(config) -> bool:
    """Whether the run keeps a frozen reference policy in its state (RL with ``loss.kl_coef`` > 0 and no
    LoRA: a LoRA run's reference is its frozen base, the adapters off)."""
    return "loss" in config and config.loss.kl_coef > 0 and not lora_enabled(config)


def build_iteration_config(config, max_response_length: int) -> RLIterationConfig:
    """The iteration options for a stage whose responses are at most ``max_response_length`` tokens."""
    loop_only = ("prompts_per_step", "off_policy_steps", "max_nonfinite_steps")  # the loop's, not the batch's
    rl = {k: v for k, v in config.rl.items() if k not in loop_only}
    return RLIterationConfig(
        **rl,
        seq_len=config.batch.max_prompt_length + max_response_length - 1,
        pack=config.batch.pack,
        row_multiple=row_multiple(config),
    )
