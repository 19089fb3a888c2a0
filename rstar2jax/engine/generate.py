"""Notebook API: generate completions for a list of prompts in one blocking call."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import NamedTuple

from rstar2jax.engine.config import EngineConfig, SamplingParams, page_rounded
from rstar2jax.engine.core import EngineCore
from rstar2jax.models import ModelConfig

# Rounding max_len keeps the compiled programs across calls of similar sizes; 256 tokens are whole pages too.
_MAX_LEN_MULTIPLE = 256


class Generation(NamedTuple):
    """One prompt's completion: sampled tokens, their raw policy log-probs, ``"eos"`` / ``"stop"`` /
    ``"budget"`` (``max_new_tokens`` reached), each token's sampling-distribution entropy and the policy
    version that sampled it (``generate``'s ``policy_version``)."""

    tokens: list[int]
    logprobs: list[float]
    finish_reason: str
    entropies: list[float] = []
    policy_versions: list[int] = []


def generate(
    params,
    config: ModelConfig,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    stop: Sequence[Sequence[int]] | None = None,
    engine_config: EngineConfig | None = None,
    policy_version: int = 0,
) -> list[Generation]:
    """Complete each prompt (token ids) with continuous batching; returns one :class:`Generation` per prompt.

    Prompt ``i`` samples with seed ``(seed, i)``, so its completion does not depend on the other prompts or on
    slot assignment. ``stop`` token sequences end a completion (the stop tokens included). With more prompts
    than fit in ``engine_config.num_slots`` (default: up to 32 slots) and its KV pages, the rest wait and
    slots and pages are reused as completions finish. ``policy_version`` tags every sampled token
    (``Generation.policy_versions``).
    """
    if not prompts:
        return []
    if engine_config is None:
        longest = max(len(p) for p in prompts) + max_new_tokens
        engine_config = EngineConfig(num_slots=min(len(prompts), 32),
                                     max_len=page_rounded(longest, _MAX_LEN_MULTIPLE))
    core = EngineCore(params, config, engine_config, policy_version=policy_version)
    sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
    stop = [] if stop is None else stop
    for prompt in prompts:
        core.check_request(prompt, 1, max_new_tokens)
    core.stop_table(stop)

    waiting = collections.deque(enumerate(prompts))
    owner, results = {}, [None] * len(prompts)
    request = lambda i, prompt: (prompt, 1, sampling, max_new_tokens, (seed, i))
    while waiting or core.num_active:
        while waiting and core.admissible([request(*waiting[0])]):
            ((record,),) = core.admit([request(*waiting[0])])
            owner[id(record)] = waiting.popleft()[0]
            core.start(record, stop)
        for record, chunk in core.step():
            record.receive(chunk)
            if chunk.finish_reason is not None:
                results[owner.pop(id(record))] = Generation(
                    record.response_ids, record.logprobs, chunk.finish_reason, record.entropies,
                    record.policy_versions)
                core.close(record)
    return results
