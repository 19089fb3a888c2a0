"""What the launchers that use a trained policy share (``experiments.evaluate``, ``chat``, ``serve``): loading
the policy (a missing or unreadable folder is one line and exit 2) and the conversation format to prompt it
in, which is the one recorded in the policy's folder (``rstar2jax_prompt.json``, written by every export)
unless a flag says otherwise. A plain HF folder records none: it is prompted by its chat template with nothing
after the generation prompt.

  from experiments import _launch, _policy_flags
  _policy_flags.define_format_flags(problem_prompt=True)
  ...
  policy = _policy_flags.load_policy_or_exit(_MODEL.value, tokenizer=..., dtype=...)
  prompt = _policy_flags.format_from_flags(policy)
"""

from __future__ import annotations

from absl import flags

from experiments import _launch

_FORMAT_FLAG_HELP = {
    "prompt_format": "Conversation format: paper (the paper's prompt and <reason> opener), bare (no system "
    "prompt, no prefix, the tool unlisted: the CPU demo's) or plain (the paper's instructions, nothing after "
    "the generation prompt). Default: the format recorded in the policy folder (rstar2jax_prompt.json), "
    "else plain.",
    "system_prompt": "System prompt, replacing the format's ('' for none).",
    "user_prefix": "Text put before each problem, replacing the format's ('' for none).",
    "assistant_opener": "Text after the chat template's generation prompt where each model turn starts, "
    "replacing the format's ('' for none; the paper's is <reason>).",
}
_SERVE_FLAG_HELP = {
    "system_prompt": "System message of requests that have none, replacing the policy's recorded system "
    "prompt ('' for none; a plain HF folder records none).",
    "assistant_opener": "Text after the chat template's generation prompt, replacing the policy's recorded "
    "opener ('' for none; a plain HF folder records none).",
}
PRESET_CHOICES = ("paper", "bare", "plain")
#: The ``--adapter`` flag of evaluate / chat / serve / export.
ADAPTER_HELP = "PEFT LoRA adapter folder merged into --model (then an HF base folder or hub name)."
STRICT_BASE_HELP = (
    "Refuse an --adapter whose base_model_name_or_path names another model than --model (by default that "
    "only warns: the architecture and every tensor's shape decide whether it fits)."
)


def define_format_flags(*, problem_prompt: bool) -> None:
    """Defines the format flags and lists them in the launcher's ``--help``: ``--prompt_format``,
    ``--system_prompt``, ``--user_prefix`` and ``--assistant_opener`` for launchers that pose problems
    (``problem_prompt``: evaluate, chat); ``--system_prompt`` and ``--assistant_opener`` for the server,
    whose clients write their own messages."""
    if problem_prompt:
        _launch.key_flag(
            flags.DEFINE_enum("prompt_format", None, PRESET_CHOICES, _FORMAT_FLAG_HELP["prompt_format"])
        )
    texts = _FORMAT_FLAG_HELP if problem_prompt else _SERVE_FLAG_HELP
    names = ("system_prompt", "user_prefix", "assistant_opener") if problem_prompt else tuple(texts)
    for name in names:
        _launch.key_flag(flags.DEFINE_string(name, None, texts[name]))


def define_adapter_flags() -> flags.FlagHolder:
    """Defines ``--adapter`` and ``--strict_base`` (listed in the launcher's ``--help``); returns the first.
    :func:`load_policy_or_exit` reads ``--strict_base``."""
    _launch.key_flag(flags.DEFINE_bool("strict_base", False, STRICT_BASE_HELP))
    return _launch.key_flag(flags.DEFINE_string("adapter", None, ADAPTER_HELP))


TOOLS_HELP = (
    "The model's tools: python (the sandbox's), a registered tool's name, or module:function (a function "
    "with type hints and an Args: docstring; see docs/extending.md). The prompt lists their schemas."
)


def define_tools_flag() -> flags.FlagHolder:
    """Defines ``--tools`` (evaluate, chat): the tools by name, read by :func:`tools_from_flags`."""
    return _launch.key_flag(flags.DEFINE_list("tools", ["python"], TOOLS_HELP))


def tools_from_flags(sandbox, prompt):
    """``(tools, prompt listing them)`` of ``--tools`` (``agent.load_tools``); a tool that does not load is
    one line and exit 2. ``sandbox`` may be None to check the flag before a sandbox is up."""
    from rstar2jax.agent.tools import load_tools

    specs = flags.FLAGS["tools"].value
    try:
        return load_tools(specs, sandbox, prompt)
    except (ValueError, TypeError) as error:
        _launch.fail(f"--tools={','.join(specs)}: {error}")


def _given(name: str):
    return flags.FLAGS[name].value if name in flags.FLAGS else None


def format_from_flags(policy):
    """The ``PromptConfig`` the flags ask for (see :func:`rstar2jax.data.conversation.prompt_format`)."""
    from rstar2jax.data.conversation import prompt_format

    return prompt_format(
        policy,
        _given("prompt_format"),
        system_prompt=_given("system_prompt"),
        user_prefix=_given("user_prefix"),
        assistant_opener=_given("assistant_opener"),
    )


def describe_format(policy, prompt) -> str:
    """One start line: where the format comes from, the system prompt and the assistant opener."""
    preset = _given("prompt_format")
    if preset:
        source = f"--prompt_format={preset}"
    elif policy.prompt is not None:
        source = "recorded with the policy"
    else:
        source = "plain (the policy folder records none)"
    fields = ("system_prompt", "user_prefix", "assistant_opener")
    replaced = [f"--{name}" for name in fields if _given(name) is not None]
    also = f" and {', '.join(replaced)}" if replaced else ""
    system = f"{len(prompt.system_prompt)} characters" if prompt.system_prompt else "none"
    opener = prompt.assistant_opener
    return f"prompt format: {source}{also}; system prompt {system}; assistant opener {opener!r}"


def load_policy_or_exit(model: str, *, tokenizer: str | None, dtype: str, adapter: str | None = None,
                        step: int | None = None):
    """``rstar2jax.serve.load_policy`` (with ``--strict_base`` where the launcher defines it); a folder that
    is missing or not a policy (no config, weights, tokenizer or checkpoint, an unreadable format file, an
    adapter of another architecture or shapes, or with a peft option this library cannot apply) is one line
    naming it and exit 2."""
    from rstar2jax.serve import load_policy

    try:
        return load_policy(model, tokenizer=tokenizer, dtype=dtype, adapter=adapter, step=step,
                           strict_base=bool(_given("strict_base")))
    except (OSError, ValueError) as error:  # FileNotFoundError, a hub name that cannot be fetched, ...
        given = f"--model={model}" + (f" --tokenizer={tokenizer}" if tokenizer else "") + (
            f" --adapter={adapter}" if adapter else "") + (f" --step={step}" if step is not None else "")
        _launch.fail(f"{given}: {error}")
