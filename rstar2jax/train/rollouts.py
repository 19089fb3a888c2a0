"""The trainer's rollout function built from a run's options (:func:`policy_rollout`): the engine on the
given parameters, the sandbox client with its outage policy and the default answer verifier, so what the
trainer, the demo and notebooks roll out is one set-up."""

from __future__ import annotations

from collections.abc import Callable

from rstar2jax.config.options import ConfigError, RunOptions
from rstar2jax.data.conversation import PromptConfig
from rstar2jax.policy.export import run_tokenizer


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
    ``agent.OutagePolicy.restart``), the default answer verifier, the run's tools (``rollout.tools``, listed
    in ``prompt``) and reward function (``reward.fn``); call its ``close()`` when done."""
    from rstar2jax import agent

    tokenizer = run_tokenizer(options)
    if tokenizer is None:
        raise ConfigError(
            "config.tokenizer is empty and config.model.path holds no tokenizer: the rollout needs the "
            "policy's tokenizer"
        )
    r = options.rl.rollout
    sandbox = agent.SandboxClient(sandbox_url, default_timeout=r.tool_timeout)
    tools, prompt = agent.load_tools(r.tools, sandbox, prompt)
    return agent.PolicyRollout(
        options.model,
        tokenizer,
        sandbox,
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
        tools=tools,
        reward=r.reward_fn or None,
    )
