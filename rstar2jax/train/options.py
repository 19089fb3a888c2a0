"""From a validated run config (the launchers' ``ml_collections.ConfigDict``) to the library's typed options:
the optimizer and its schedule, the loss and iteration options, the conversation format, the tokenizer."""

from __future__ import annotations

import math
import os
from typing import Any

from rstar2jax.data.conversation import PromptConfig, load_prompt_config
from rstar2jax.train.selection import RLIterationConfig
from rstar2jax.train.state import learning_rate_schedule, make_optimizer
from rstar2jax.train.steps import RLLossConfig


def lora_enabled(config) -> bool:
    """Whether the run trains LoRA adapters (``config.model.lora.rank`` > 0) instead of all weights."""
    return bool(config.model.get("lora") and config.model.lora.rank)


def row_multiple(config) -> int:
    """Batch rows must split into micro-batches whose rows split over the data-parallel devices."""
    return config.num_microbatches * config.mesh.data * config.mesh.fsdp


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
