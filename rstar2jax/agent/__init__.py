"""Multi-turn tool rollouts (:func:`rollout`, :func:`rollout_async`), the trajectory record, tool-call
parsing, the prompt protocol and the sandbox client.

Importing starts nothing: no JAX backend, no sandbox server, no verifier process.
"""

from rstar2jax.agent.prompts import (
    PYTHON_TOOL_NAME,
    PromptConfig,
    format_tool_result,
    python_tool_schema,
    render_prompt_ids,
    render_prompt_text,
    tool_response_ids,
    tool_response_text,
)
from rstar2jax.agent.rollout import (
    PolicyRollout,
    RolloutConfig,
    RolloutEngine,
    RolloutSession,
    ToolSandbox,
    rollout,
    rollout_async,
    tool_outcome,
)
from rstar2jax.agent.sandbox_client import SandboxClient, SandboxResult, SyncSandboxClient, run_code_sync
from rstar2jax.agent.tool_parser import (
    ToolCall,
    ToolCallError,
    ToolCallErrorKind,
    parse_tool_call,
    parse_tool_calls,
)
from rstar2jax.agent.trajectory import FAILED_OUTCOMES, ToolOutcome, Trajectory

__all__ = [
    "FAILED_OUTCOMES",
    "PYTHON_TOOL_NAME",
    "PolicyRollout",
    "PromptConfig",
    "RolloutConfig",
    "RolloutEngine",
    "RolloutSession",
    "SandboxClient",
    "SandboxResult",
    "SyncSandboxClient",
    "ToolCall",
    "ToolCallError",
    "ToolCallErrorKind",
    "ToolOutcome",
    "ToolSandbox",
    "Trajectory",
    "format_tool_result",
    "parse_tool_call",
    "parse_tool_calls",
    "python_tool_schema",
    "render_prompt_ids",
    "render_prompt_text",
    "rollout",
    "rollout_async",
    "run_code_sync",
    "tool_outcome",
    "tool_response_ids",
    "tool_response_text",
]
