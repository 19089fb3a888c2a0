"""Non-reasoning SFT data in the rStar2-Agent format, and token ids + loss mask from a chat template.

Each conversation is the paper's multi-turn tool use (Fig. 2-3) in the Hugging Face chat format::

    system     the prompt (with the tool schema passed to the template as ``tools``)
    user       user prefix + problem
    assistant  <reason>plan</reason> + tool_calls [execute_python_code_with_standard_io(code, input)]
    tool       what the sandbox really printed
    (assistant <reason>the error</reason> + tool_calls [the fixed code];  tool  its real output)
    assistant  <reason>the output</reason>\\n<answer>The answer is \\boxed{N}.</answer>

A configurable share of conversations first calls a realistically broken version of the reference code
(``BUG_KINDS``), gets the real error back and fixes it on the next call, so that the SFT policy makes and
repairs real tool errors that GRPO-RoC can then select against. Tool outputs are never invented: every call
runs through the injected ``run_code`` (the sandbox client), and the answers are checked against the gold.

This module takes the prompt text, tool name and tool-output formatting as arguments (``data`` sits below
``agent``; the caller passes ``agent.prompts`` values) so the SFT text matches what rollouts will see.
"""

from __future__ import annotations

import ast
import concurrent.futures
import dataclasses
import random
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import tqdm.auto as tqdm
from transformers import PreTrainedTokenizerBase

from rstar2jax.data.synthetic import SyntheticProblem
from rstar2jax.models.tokenizer import encode_text, render_chat

#: ``run_code(code, stdin) -> {"status": "ok" | "error" | "timeout" | ..., "stdout": str, "stderr": str}``.
RunCode = Callable[[str, str], Mapping[str, Any]]

#: Injected bugs. All but ``missing_print`` raise, so they are tool errors for RoC's p_err.
BUG_KINDS = ("name_error", "syntax_error", "type_error", "missing_import", "missing_print")
DEFAULT_BUG_KINDS = ("name_error", "syntax_error", "type_error", "missing_import")

PLAN_REASON = "I will compute it with Python."
FIX_REASON = "The code raised {error}. I will fix it and run it again."
NO_OUTPUT_REASON = "The code printed nothing. I will print the result."
FINAL_TEXT = (
    "<reason>The code printed {answer}.</reason>\n<answer>The answer is \\boxed{{{answer}}}.</answer>"
)

# Plausible wrong names for the variables of the reference snippets (a NameError when used).
_MISSPELLINGS = {
    "a": "base",
    "b": "exp",
    "m": "mod",
    "n": "N",
    "p": "prod",
    "s": "total",
    "x": "fib",
    "nums": "numbers",
    "lo": "low",
    "hi": "high",
}
_PRINT_LINE = re.compile(r"print\((?P<expr>.*)\)")


@dataclasses.dataclass(frozen=True)
class SFTExample:
    """One SFT conversation; ``bug_kind`` names the injected first-call bug, or None for a clean solve."""

    problem_id: str
    messages: list[dict[str, Any]]
    bug_kind: str | None


def _split_print(code: str) -> tuple[str, str]:
    """(everything before the last line, the printed expression); snippets end with ``print(expr)``."""
    head, _, last = code.rpartition("\n")
    match = _PRINT_LINE.fullmatch(last)
    if match is None:
        raise ValueError(f"reference solution must end with a print(...) line, got {last!r}")
    return head + "\n" if head else "", match["expr"]


def inject_bug(code: str, kind: str, rng: random.Random) -> str | None:
    """A realistically broken ``code`` (which ends with ``print(expr)``), or None if ``kind`` cannot apply.

    ``name_error`` misspells a variable in the printed expression, ``syntax_error`` drops the closing
    parenthesis, ``type_error`` concatenates a string and the integer, ``missing_import`` drops
    ``import math``, ``missing_print`` assigns the result instead of printing it.
    """
    head, expr = _split_print(code)
    if kind == "syntax_error":
        return f"{head}print({expr}"
    if kind == "type_error":
        return f'{head}print("Answer: " + {expr})'
    if kind == "missing_print":
        return f"{head}result = {expr}"
    if kind == "missing_import":
        return code.replace("import math\n", "", 1) if code.startswith("import math\n") else None
    if kind == "name_error":
        assigned = {
            name.id
            for statement in ast.parse(code).body
            if isinstance(statement, ast.Assign)
            for target in statement.targets
            for name in ast.walk(target)
            if isinstance(name, ast.Name)
        }
        used = sorted({n.id for n in ast.walk(ast.parse(expr)) if isinstance(n, ast.Name)} & assigned)
        if not used:
            return None
        name = rng.choice(used)
        typo = _MISSPELLINGS.get(name, f"{name}_value")
        misspelled = re.sub(rf"\b{name}\b", typo, expr, count=1)
        return f"{head}print({misspelled})"
    raise ValueError(f"unknown bug kind {kind!r}; choose from {BUG_KINDS}")


def _error_line(result: Mapping[str, Any]) -> str:
    """The last line of the traceback (``NameError: name 'N' is not defined``), or the status."""
    lines = [line.strip() for line in str(result.get("stderr") or "").splitlines() if line.strip()]
    return lines[-1] if lines else str(result["status"])


@dataclasses.dataclass(frozen=True)
class _ConversationWriter:
    """Writes one conversation, running every tool call for real."""

    run_code: RunCode
    format_tool_output: Callable[[Mapping[str, Any]], str]
    system_prompt: str
    user_prefix: str
    tool_name: str

    def _call(self, reason: str, code: str) -> tuple[list[dict[str, Any]], Mapping[str, Any]]:
        """The assistant turn calling the tool on ``code`` and the tool turn with its real result."""
        arguments = {"code": code, "input": ""}
        call = {"type": "function", "function": {"name": self.tool_name, "arguments": arguments}}
        result = self.run_code(code, "")
        turns = [
            {"role": "assistant", "content": f"<reason>{reason}</reason>", "tool_calls": [call]},
            {"role": "tool", "content": self.format_tool_output(result)},
        ]
        return turns, result

    def __call__(self, problem: SyntheticProblem, buggy_code: str | None, bug_kind: str | None) -> SFTExample:
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        messages.append({"role": "user", "content": self.user_prefix + problem.problem})
        reason = PLAN_REASON
        if buggy_code is not None:
            turns, failed = self._call(reason, buggy_code)
            messages += turns
            if bug_kind == "missing_print":
                if failed["status"] != "ok" or str(failed.get("stdout") or "").strip():
                    raise RuntimeError(f"{problem.id}: code without print() printed or failed: {failed!r}")
                reason = NO_OUTPUT_REASON
            else:
                if failed["status"] == "ok":
                    raise RuntimeError(f"{problem.id}: the injected {bug_kind} ran cleanly: {buggy_code!r}")
                reason = FIX_REASON.format(error=_error_line(failed))
        turns, result = self._call(reason, problem.solution)
        printed = str(result.get("stdout") or "").strip()
        if result["status"] != "ok" or printed != problem.answer:
            raise RuntimeError(f"{problem.id}: reference code gave {result!r}, expected {problem.answer!r}")
        messages += turns
        messages.append({"role": "assistant", "content": FINAL_TEXT.format(answer=printed)})
        return SFTExample(problem.id, messages, bug_kind)


def build_sft_examples(
    problems: Sequence[SyntheticProblem],
    run_code: RunCode,
    *,
    format_tool_output: Callable[[Mapping[str, Any]], str],
    system_prompt: str = "",
    user_prefix: str = "",
    tool_name: str = "execute_python_code_with_standard_io",
    fail_rate: float = 0.3,
    bug_kinds: Sequence[str] = DEFAULT_BUG_KINDS,
    seed: int = 0,
    max_workers: int = 1,
    progress: bool = False,
) -> list[SFTExample]:
    """Tool-use conversations solving ``problems``, a ``fail_rate`` share of them after fixing a bug.

    Args:
      problems: synthetic problems (their ``solution`` is the code the assistant runs).
      run_code: runs ``(code, stdin)``, returns the sandbox result (``status``, ``stdout``, ``stderr``).
        Called ``len(problems) + round(fail_rate * len(problems))`` times.
      format_tool_output: sandbox result -> tool message text; pass the rollout's formatter
        (``functools.partial(agent.prompts.format_tool_result, max_chars=...)``) so SFT matches RL.
      system_prompt / user_prefix: the system turn ('' for none) and the text before the problem in the
        user turn (``agent.prompts.PromptConfig`` fields). The tool schema goes to the chat template later.
      tool_name: the Python tool's function name (the paper's by default).
      fail_rate: exact share (rounded) of conversations whose first call is broken, then fixed.
      bug_kinds: which ``BUG_KINDS`` to inject; each failing conversation gets one that applies to its code.
      seed: picks the failing conversations, their bug kinds and the misspelled names.
      max_workers: threads calling ``run_code`` (it must then be thread-safe; an HTTP sandbox client is).
      progress: show a progress bar (on a terminal only).

    Returns:
      One ``SFTExample`` per problem, in order. Raises RuntimeError if a broken call runs cleanly or the
      reference code does not print the gold answer (the sandbox disagrees with the task).
    """
    if not 0.0 <= fail_rate <= 1.0:
        raise ValueError(f"fail_rate must be in [0, 1], got {fail_rate}")
    unknown = [kind for kind in bug_kinds if kind not in BUG_KINDS]
    if unknown or (fail_rate > 0 and not bug_kinds):
        raise ValueError(f"bug_kinds must be a non-empty subset of {BUG_KINDS}, got {tuple(bug_kinds)}")
    if max_workers < 1:
        raise ValueError(f"max_workers must be >= 1, got {max_workers}")
    rng = random.Random(seed)
    candidates = [
        {kind: code for kind in bug_kinds if (code := inject_bug(p.solution, kind, rng)) is not None}
        for p in problems
    ]
    eligible = [i for i, bugs in enumerate(candidates) if bugs]
    num_failing = round(fail_rate * len(problems))
    if num_failing > len(eligible):
        raise ValueError(
            f"fail_rate={fail_rate} needs {num_failing} broken first calls but only {len(eligible)} problems "
            f"admit one of {tuple(bug_kinds)}"
        )
    chosen_kinds: list[str | None] = [None] * len(problems)
    for i in sorted(rng.sample(eligible, num_failing)):
        chosen_kinds[i] = rng.choice(sorted(candidates[i]))
    buggy_codes = [bugs.get(kind) for bugs, kind in zip(candidates, chosen_kinds, strict=True)]
    write = _ConversationWriter(run_code, format_tool_output, system_prompt, user_prefix, tool_name)
    with concurrent.futures.ThreadPoolExecutor(max_workers) as pool:
        written = pool.map(write, problems, buggy_codes, chosen_kinds)
        return list(
            tqdm.tqdm(
                written, total=len(problems), desc="sft data", unit="conv", disable=None if progress else True
            )
        )


@dataclasses.dataclass(frozen=True)
class TokenizedConversation:
    """Token ids of a conversation and the SFT loss mask (1 on tokens the assistant wrote, 0 elsewhere)."""

    input_ids: list[int]
    loss_mask: list[int]


_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
# A user turn appended after an assistant turn so that the template renders it as a finished, earlier turn.
_NEXT_TURN_PROBE = "\x00next-turn-probe\x00"


def tokenize_conversation(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    assistant_opener: str = "",
    end_of_turn: str | None = None,
    **template_kwargs: Any,
) -> TokenizedConversation:
    """Token ids and loss mask of a chat, with 1 exactly on the assistant-written tokens.

    Templates with ``{% generation %}`` tags and no ``assistant_opener`` use HF's
    ``apply_chat_template(return_assistant_tokens_mask=True)``. Otherwise (Qwen3's template,
    ``models.tokenizer.CHATML_TOOLS_TEMPLATE``, or with an opener, which a rollout encodes together with
    the inserted text while a whole-text tokenization may merge it into the assistant's first word) the chat
    is rendered incrementally, the way a rollout builds its token stream: for each assistant turn, the
    template's rendering of the history with the generation prompt (+ ``assistant_opener``) is inserted
    (mask 0), then the assistant's text up to and including ``end_of_turn`` (mask 1). Pieces are encoded
    separately, as a rollout encodes them, and each history rendering must extend the previous one (else
    ValueError). Rendering each assistant turn as a finished, earlier turn also keeps last-turn quirks
    (Qwen3's empty ``<think>`` block) out of the data.

    Args:
      tokenizer: a tokenizer with a chat template.
      messages: HF chat messages ending with an assistant turn (e.g. ``SFTExample.messages``).
      tools: tool schemas for the template's tools block (``agent.prompts.PromptConfig.tools``).
      assistant_opener: text the rollout inserts at the start of every assistant turn (``"<reason>"``); it
        must start each assistant message's content and gets mask 0.
      end_of_turn: the text that ends an assistant turn (default ``tokenizer.eos_token``), incremental mode.
      **template_kwargs: extra chat-template variables (e.g. ``enable_thinking``).
    """
    roles = [m.get("role") for m in messages]
    if not roles or roles[-1] != "assistant":
        raise ValueError(
            f"messages must end with an assistant turn (nothing to train after it); roles {roles}"
        )
    for i, message in enumerate(messages):
        content = message.get("content") or ""
        if message["role"] == "assistant" and not content.startswith(assistant_opener):
            raise ValueError(f"assistant message {i} does not start with the opener {assistant_opener!r}")
    tools = [dict(t) for t in tools] if tools else None
    if not assistant_opener and _GENERATION_TAG.search(tokenizer.get_chat_template(tools=tools)):
        return _tokenize_with_generation_tags(tokenizer, messages, tools, template_kwargs)
    end_of_turn = end_of_turn or tokenizer.eos_token
    if not end_of_turn:
        raise ValueError(
            "the tokenizer has no eos_token; pass end_of_turn (the text closing an assistant turn)"
        )

    input_ids: list[int] = []
    loss_mask: list[int] = []
    covered = ""  # the rendered text the ids encode so far
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        history = render_chat(
            tokenizer, messages[:i], tools=tools, add_generation_prompt=True, **template_kwargs
        )
        prompt = history + assistant_opener
        if not prompt.startswith(covered):
            raise ValueError(
                f"the chat template re-renders earlier turns differently once message {i} follows; it is not "
                "prefix-stable, so no rollout could have produced this token stream"
            )
        probe_messages = [*messages[: i + 1], {"role": "user", "content": _NEXT_TURN_PROBE}]
        rendered = render_chat(tokenizer, probe_messages, tools=tools, **template_kwargs)
        end = rendered.find(end_of_turn, len(prompt))
        if not rendered.startswith(prompt) or not 0 <= end < rendered.index(_NEXT_TURN_PROBE):
            raise ValueError(
                f"assistant message {i} is not rendered as generation prompt + content + {end_of_turn!r}: "
                f"{rendered[len(history) : rendered.index(_NEXT_TURN_PROBE)]!r}"
            )
        end += len(end_of_turn)
        for text, trainable in ((prompt[len(covered) :], 0), (rendered[len(prompt) : end], 1)):
            ids = encode_text(tokenizer, text)
            input_ids += ids
            loss_mask += [trainable] * len(ids)
        covered = rendered[:end]
    return TokenizedConversation(input_ids, loss_mask)


def _tokenize_with_generation_tags(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    tools: list[dict[str, Any]] | None,
    template_kwargs: Mapping[str, Any],
) -> TokenizedConversation:
    encoded = tokenizer.apply_chat_template(
        [dict(m) for m in messages],
        tools=tools,
        return_dict=True,
        return_assistant_tokens_mask=True,
        **template_kwargs,
    )
    loss_mask = list(encoded["assistant_masks"])
    # Drop what the template writes after the last assistant turn (e.g. its newline): no rollout holds it.
    length = max(t + 1 for t, m in enumerate(loss_mask) if m)
    return TokenizedConversation(list(encoded["input_ids"])[:length], loss_mask[:length])
