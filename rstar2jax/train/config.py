"""Run configuration (ml_collections): the defaults of the RL and SFT configs and their stages.

A config file (see ``experiments/configs/``) starts from ``rl_config()`` or ``sft_config()`` and overrides
fields; launchers accept ``--config.a.b=value`` on top. What each field means is
``rstar2jax.train.field_help``'s; the checks are ``rstar2jax.train.validation``'s; the conversion into the
library's typed options is ``rstar2jax.train.options``'s (all re-exported here, where configs and launchers
import them).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import TYPE_CHECKING

from rstar2jax.models.lora import LORA_TARGETS
from rstar2jax.train.field_help import FIELD_HELP, field_help
from rstar2jax.train.options import (
    build_iteration_config,
    build_loss_config,
    lora_enabled,
    prompt_from_config,
    row_multiple,
    tokenizer_path,
)
from rstar2jax.train.selection import RLIterationConfig
from rstar2jax.train.validation import (
    KINDS,
    ConfigError,
    validate,
    validate_rl_config,
    validate_sft_config,
)

if TYPE_CHECKING:
    import ml_collections

#: ``RLIterationConfig`` fields the loop sets per stage (from ``batch`` and ``mesh``): not ``rl.*`` fields.
_SET_BY_THE_LOOP = ("seq_len", "pack", "row_multiple")


def _iteration_defaults() -> dict:
    fields = dataclasses.fields(RLIterationConfig)
    return {f.name: f.default for f in fields if f.name not in _SET_BY_THE_LOOP}

__all__ = [
    "FIELD_HELP",
    "KINDS",
    "ConfigError",
    "build_iteration_config",
    "build_loss_config",
    "field_help",
    "lora_enabled",
    "placeholder",
    "RUN_CONFIG_FILE",
    "read_run_config",
    "write_run_config",
    "prompt_from_config",
    "rl_config",
    "row_multiple",
    "sft_config",
    "stage",
    "tokenizer_path",
    "validate",
    "validate_rl_config",
    "validate_sft_config",
]


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
    c.model.attention = "auto"  # auto | blockwise | pallas_triton | jax_pallas_mha | tokamax | dense
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
            # The iteration's options (2G, G, RoC, advantages, format penalty, truncation): their defaults are
            # RLIterationConfig's, stated once there.
            **_iteration_defaults(),
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


#: The run's config as JSON, in its work folder: what loads the run's checkpoints without the launcher
#: (``rstar2jax.serve.load_policy`` reads the model and tokenizer from it).
RUN_CONFIG_FILE = "run_config.json"


def write_run_config(workdir: pathlib.Path, config) -> pathlib.Path:
    """Writes ``config`` (an ``ml_collections.ConfigDict``, or its JSON text: ``RunOptions.record``) as
    ``workdir/run_config.json``."""
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / RUN_CONFIG_FILE
    temporary = path.with_suffix(".json.tmp")
    text = config if isinstance(config, str) else config.to_json_best_effort(indent=1)
    temporary.write_text(text, encoding="utf-8")
    temporary.replace(path)
    return path


def read_run_config(workdir: str | pathlib.Path):
    """The run config a run wrote into ``workdir`` (``write_run_config``), as a ``ConfigDict``."""
    return _config_dict(json.loads((pathlib.Path(workdir) / RUN_CONFIG_FILE).read_text(encoding="utf-8")))
