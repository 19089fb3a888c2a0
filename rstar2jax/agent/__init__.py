"""Multi-turn tool rollouts (:func:`rollout`, :func:`rollout_async`) and the sandbox client; for convenience
also the names of the conversation format, the trajectory record and the tool-call parser, which live in
``rstar2jax.data`` (``data.conversation``, ``data.trajectory``, ``data.tool_parser``) because the trainer and
the SFT data use them too.

Importing starts nothing: no JAX backend, no sandbox server, no verifier process. Names load on first use,
so ``from rstar2jax.agent.sandbox_client import SandboxClient`` costs aiohttp and msgpack, not JAX and
transformers: a client process keeps a small heap, and its full garbage collections stay short.
"""

import importlib

_NAMES = {
    "rstar2jax.data.conversation": [
        "PYTHON_TOOL_NAME",
        "PromptConfig",
        "load_prompt_config",
        "python_tool_schema",
        "render_prompt_ids",
        "render_prompt_text",
        "tool_response_ids",
        "tool_response_text",
    ],
    "rstar2jax.data.tool_result": [
        "ToolResult",
        "format_tool_result",
    ],
    "rstar2jax.agent.tools": [
        "FunctionTool",
        "PythonTool",
        "Tool",
        "TOOLS",
        "load_tool",
        "load_tools",
        "register_tool",
    ],
    "rstar2jax.agent.multi_turn": [
        "PolicyRollout",
        "Conversation",
        "converse_async",
        "rollout",
        "rollout_async",
    ],
    "rstar2jax.agent.stream": [
        "RolloutStream",
        "StreamSpec",
    ],
    "rstar2jax.agent.session": [
        "SessionLoop",
    ],
    "rstar2jax.agent.rollout_types": [
        "PartialRollout",
        "RolloutConfig",
        "RolloutEngine",
        "RolloutSession",
        "SessionRecord",
        "ToolSandbox",
        "Observer",
        "tool_outcome",
    ],
    "rstar2jax.agent.outage": [
        "OutagePolicy",
        "SandboxUnavailable",
    ],
    "rstar2jax.agent.sandbox_client": [
        "SandboxClient",
        "SyncSandboxClient",
        "run_code_sync",
    ],
    "rstar2jax.agent.sandbox_wire": [
        "SandboxResult",
    ],
    "rstar2jax.data.tool_parser": [
        "FunctionCall",
        "ToolCall",
        "ToolCallError",
        "ToolCallErrorKind",
        "parse_tool_call",
        "parse_tool_calls",
        "parse_function_call",
        "parse_function_calls",
        "tool_call_bodies",
    ],
    "rstar2jax.data.trajectory": [
        "FAILED_OUTCOMES",
        "ToolOutcome",
        "Trajectory",
    ],
}
_MODULE_OF = {name: module for module, names in _NAMES.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name in _MODULE_OF:
        module = importlib.import_module(_MODULE_OF[name])
        for attr in _NAMES[_MODULE_OF[name]]:  # the module's other names too: one import, one lookup
            globals()[attr] = getattr(module, attr)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return globals()[name]


def __dir__():
    return __all__
