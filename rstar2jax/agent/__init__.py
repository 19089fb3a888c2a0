"""Multi-turn tool rollouts (:func:`rollout`, :func:`rollout_async`), the trajectory record, tool-call
parsing, the prompt protocol and the sandbox client.

Importing starts nothing: no JAX backend, no sandbox server, no verifier process. Names load on first use
(``lazy_loader``), so ``from rstar2jax.agent.sandbox_client import SandboxClient`` costs aiohttp and msgpack,
not JAX and transformers: a client process keeps a small heap, and its full garbage collections stay short.
"""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach(
    __name__,
    submod_attrs={
        "prompts": [
            "PYTHON_TOOL_NAME",
            "PromptConfig",
            "format_tool_result",
            "python_tool_schema",
            "render_prompt_ids",
            "render_prompt_text",
            "tool_response_ids",
            "tool_response_text",
        ],
        "rollout": [
            "PolicyRollout",
            "RolloutConfig",
            "RolloutEngine",
            "Conversation",
            "Observer",
            "RolloutSession",
            "converse_async",
            "ToolSandbox",
            "rollout",
            "rollout_async",
            "tool_outcome",
        ],
        "sandbox_client": [
            "SandboxClient",
            "SandboxResult",
            "SyncSandboxClient",
            "run_code_sync",
        ],
        "tool_parser": [
            "FunctionCall",
            "ToolCall",
            "ToolCallError",
            "ToolCallErrorKind",
            "parse_tool_call",
            "parse_function_call",
            "parse_function_calls",
            "parse_tool_calls",
            "tool_call_bodies",
        ],
        "trajectory": [
            "FAILED_OUTCOMES",
            "ToolOutcome",
            "Trajectory",
        ],
    },
)
