"""A trained policy as a library user handles it: load it (``load_policy``, ``rstar2jax.train.loader``'s),
export a run's latest checkpoint as a Hugging Face folder (what ``config.model.path`` and
``models.load_pretrained`` read), build the real rollout function (engine + sandbox + verifier) from an RL
run's options, and evaluate a policy on held-out problems.

The staged demo recipe that wires these together lives in ``experiments/demo_recipe.py``.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from rstar2jax.data.conversation import PromptConfig, render_prompt_ids
from rstar2jax.data.problems import Problem
from rstar2jax.data.tokenizer import load_tokenizer
from rstar2jax.eval.evaluate import DatasetEval, aggregate
from rstar2jax.train import loader
from rstar2jax.train import lora as lora_lib
from rstar2jax.train.loader import Policy as Policy  # re-exported: a policy is loaded here as well
from rstar2jax.train.loader import load_policy as load_policy
from rstar2jax.train.options import ConfigError, RunOptions
from rstar2jax.train.run import save_policy
from rstar2jax.train.schedule import RolloutFn


def run_tokenizer(options: RunOptions):
    """The run's tokenizer (``config.tokenizer``, else the one in ``config.model.path``), or None."""
    path = options.policy.tokenizer
    return load_tokenizer(path) if path else None


def export_policy(options: RunOptions, out: pathlib.Path) -> pathlib.Path:
    """Writes the latest checkpoint's parameters of a run (its ``RunOptions``; restored as ``load_policy``
    restores them, ``loader.latest_run_params``) as a HF folder (config.json, safetensors, the run's
    tokenizer with its chat template and the run's conversation format), the form
    ``config.model.path`` and ``load_pretrained`` read. A LoRA run's policy is its base with the adapters
    merged in, and its adapters alone are written beside it as a PEFT folder
    (``train.lora.adapter_folder(out)``)."""
    restored = loader.latest_run_params(options.policy, options.workdir)
    if restored is None:
        raise FileNotFoundError(f"{options.workdir}: no checkpoint to export")
    out = save_policy(restored.params, restored.model_config, out, tokenizer=run_tokenizer(options),
                      prompt=options.policy.prompt)
    if restored.lora is not None:
        source = options.policy.source
        lora_lib.save_adapter(restored.adapters, source, restored.model_config, restored.lora, out)
    return out


def policy_rollout(
    options: RunOptions,
    sandbox_url: str,
    prompt: PromptConfig,
    *,
    restart_sandbox: Callable[[], str | None] | None = None,
):
    """The trainer's rollout function from an RL run's ``RunOptions`` (the same object the trainer reads, so
    the engine's model and sampling temperature are the trainer's): the engine on the given parameters, the
    sandbox at ``sandbox_url`` (waited for up to ``rollout.sandbox_outage_s`` when it does not answer;
    ``restart_sandbox``: for a sandbox the run started, restarts it if it died, see
    ``agent.OutagePolicy.restart``), the default answer verifier; call its ``close()`` when done."""
    from rstar2jax import agent

    tokenizer = run_tokenizer(options)
    if tokenizer is None:
        raise ConfigError(
            "config.tokenizer is empty and config.model.path holds no tokenizer: the rollout needs the "
            "policy's tokenizer"
        )
    r = options.rl.rollout
    return agent.PolicyRollout(
        options.model,
        tokenizer,
        agent.SandboxClient(sandbox_url, default_timeout=r.tool_timeout),
        engine_config=r.engine,
        max_prompt_length=options.rl.max_prompt_length,
        partial_segment_tokens=r.partial_segment_tokens,
        outage=agent.OutagePolicy(budget_s=r.sandbox_outage_s, restart=restart_sandbox),
        config=agent.RolloutConfig(
            max_tool_calls_per_turn=r.max_tool_calls_per_turn,
            tool_timeout=r.tool_timeout,
            tool_output_chars=r.tool_output_chars,
            sampling=r.sampling,
            prompt=prompt,
        ),
    )


def evaluate_policy(
    params,
    problems: Sequence[Problem],
    rollout_fn: RolloutFn,
    *,
    samples: int,
    max_response_length: int,
    max_turns: int,
    seed: int,
) -> DatasetEval:
    """Average pass@1 over ``samples`` rollouts per held-out problem, plus tool-use statistics (one batched
    rollout call: the engine decodes every problem's group side by side)."""
    trajectories = rollout_fn(
        params,
        list(problems),
        samples_per_problem=samples,
        max_response_length=max_response_length,
        max_turns=max_turns,
        seed=seed,
    )
    groups: dict[str, list] = {p.id: [] for p in problems}
    for t in trajectories:
        groups[t.problem_id].append(t)
    return aggregate(problems, [groups[p.id] for p in problems])


def save_evaluation(result: DatasetEval, path: pathlib.Path, **extra: Any) -> dict[str, Any]:
    """Writes an evaluation's metrics and per-problem correctness as JSON; returns what it wrote."""
    record = {
        **extra,
        "metrics": result.metrics,
        "problem_ids": result.problem_ids,
        "correct": np.asarray(result.correct).astype(int).tolist(),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1), encoding="utf-8")
    return record


def max_prompt_tokens(tokenizer, problems: Sequence[Problem], prompt: PromptConfig) -> int:
    """The longest rendered prompt among ``problems`` (the engine's prompt budget must cover it)."""
    return max(len(render_prompt_ids(tokenizer, p.problem, prompt)) for p in problems)
