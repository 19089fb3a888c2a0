"""Loads a policy to evaluate, chat with or serve, and picks the format it is prompted in.

:func:`load_policy` and :class:`Policy` are the trainer's (``rstar2jax.train.loader``: an HF model folder, a
hub name or a training run folder, through the loaders training uses, so what is served is what was trained).

The conversation format the policy was trained in comes with it (:attr:`Policy.prompt`): the
``rstar2jax_prompt.json`` an export writes into an HF folder, or a run's ``config.prompt``. A plain HF folder
has none: it is prompted by its chat template alone (:func:`prompt_format`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from rstar2jax.data.conversation import PromptConfig
from rstar2jax.train.loader import Policy, load_policy

__all__ = ["PROMPTS", "Policy", "load_policy", "prompt_format"]

#: Named formats: ``paper`` (the paper's system prompt, user prefix, listed Python tool and ``<reason>``
#: opener), ``bare`` (no system prompt, no prefix, the tool callable but unlisted: the CPU demo's policies)
#: and ``plain`` (the paper's instructions and tool with nothing after the generation prompt: how a plain HF
#: model, which records no format, is evaluated and chatted with).
PROMPTS: dict[str, Callable[[], PromptConfig]] = {
    "paper": PromptConfig,
    "bare": lambda: PromptConfig(system_prompt="", user_prefix="", list_tools=False),
    "plain": lambda: PromptConfig(assistant_opener=""),
}


def prompt_format(
    policy: Policy,
    preset: str | None = None,
    *,
    system_prompt: str | None = None,
    user_prefix: str | None = None,
    assistant_opener: str | None = None,
) -> PromptConfig:
    """The format to prompt ``policy`` in: the named ``preset`` (:data:`PROMPTS`) when given, else the one it
    was trained in (:attr:`Policy.prompt`), else ``plain``; each field given here replaces that format's."""
    if preset is not None and preset not in PROMPTS:
        raise ValueError(f"prompt format {preset!r}: expected one of {sorted(PROMPTS)}")
    base = PROMPTS[preset]() if preset else policy.prompt or PROMPTS["plain"]()
    overrides = dict(system_prompt=system_prompt, user_prefix=user_prefix, assistant_opener=assistant_opener)
    return dataclasses.replace(base, **{k: v for k, v in overrides.items() if v is not None})
