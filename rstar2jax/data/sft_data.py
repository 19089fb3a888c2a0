"""SFT data: non-reasoning tool-use conversations in the rStar2-Agent format; SFT files as token sequences.

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

The prompt text, tool name and tool-output formatting come from ``rstar2jax.data.conversation`` (the caller
may pass its own), so the SFT text matches what rollouts will see. :func:`load_sft_sequences` reads an SFT
file (chats or pre-tokenised rows) into the ``TokenSequence``s the SFT step packs.
"""

from __future__ import annotations

import ast
import concurrent.futures
import dataclasses
import json
import os
import random
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import tqdm.auto as tqdm

from rstar2jax.data.batch import TokenSequence
from rstar2jax.data.chat_template import tokenize_conversation
from rstar2jax.data.conversation import PromptConfig, prompt_messages
from rstar2jax.data.synthetic import SyntheticProblem

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
    prompt: PromptConfig
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
        messages: list[dict[str, Any]] = prompt_messages(problem.problem, self.prompt)
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
    prompt: PromptConfig | None = None,
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
        (``functools.partial(conversation.format_tool_result, max_chars=...)``) so SFT matches RL.
      prompt: the prompt the policy will be rolled out in (default the paper's): the conversations start
        with its ``conversation.prompt_messages`` and call its first tool (the Python tool). The tool schemas
        go to the chat template later (:func:`sft_rows`).
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
    prompt = prompt or PromptConfig()
    if not prompt.tools:
        raise ValueError("prompt.tools is empty: the conversations call the Python tool")
    write = _ConversationWriter(run_code, format_tool_output, prompt, prompt.tool_names[0])
    with concurrent.futures.ThreadPoolExecutor(max_workers) as pool:
        written = pool.map(write, problems, buggy_codes, chosen_kinds)
        return list(
            tqdm.tqdm(
                written, total=len(problems), desc="sft data", unit="conv", disable=None if progress else True
            )
        )

def sft_rows(examples: Sequence[SFTExample], prompt: PromptConfig | None = None) -> list[dict[str, Any]]:
    """The rows of an SFT file for ``examples`` written in ``prompt`` (default the paper's): the messages,
    the tool schemas the chat template lists (``prompt.listed_tools``) and the assistant opener."""
    prompt = prompt or PromptConfig()
    return [
        {"messages": e.messages, "tools": prompt.listed_tools, "assistant_opener": prompt.assistant_opener}
        for e in examples
    ]


#: The roles a chat row may use.
CHAT_ROLES = ("system", "user", "assistant", "tool")


def _chat_row(row: Mapping[str, Any]) -> tuple[list[dict[str, Any]], list[Any] | None, str]:
    """(messages, tools, assistant opener) of a chat row, in the form the chat template takes.

    Accepts what function-calling data sets ship: ``tools`` as a list or a JSON string, assistant
    ``tool_calls`` as ``{"function": {"name", "arguments"}}`` or ``{"name", "arguments"}`` with the arguments
    a mapping or a JSON string, ``content`` None beside tool calls, and extra keys (``tool_call_id``, ...).
    """
    tools = row.get("tools")
    if isinstance(tools, str):
        tools = json.loads(tools) if tools.strip() else None
    if tools is not None and not isinstance(tools, list):
        raise ValueError(f"'tools' must be a list of schemas (or its JSON), got {type(tools).__name__}")
    messages = []
    for i, message in enumerate(row["messages"]):
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise ValueError(f"message {i} has role {role!r}; expected one of {CHAT_ROLES}")
        message = {**message, "content": message.get("content") or ""}
        if message.get("tool_calls"):
            calls = []
            for call in message["tool_calls"]:
                function = dict(call.get("function", call))
                if isinstance(function.get("arguments"), str):
                    try:
                        function["arguments"] = json.loads(function["arguments"])
                    except json.JSONDecodeError as error:
                        raise ValueError(f"message {i}: tool call arguments are not JSON: {error}") from None
                calls.append({"type": "function", "function": function})
            message["tool_calls"] = calls
        else:
            message.pop("tool_calls", None)
        messages.append(message)
    return messages, tools, row.get("assistant_opener", "")


def read_sft_rows(source: str | os.PathLike | Iterable[Mapping[str, Any]]) -> Iterator[tuple[str, Any]]:
    """``(where, row)`` for each row of an SFT source: a ``.jsonl`` file (one row a line), a ``.json`` file
    (a list of rows), a ``.parquet`` file, or rows in memory (a ``datasets.Dataset``, a list of dicts)."""
    if not isinstance(source, str | os.PathLike):
        for index, row in enumerate(source):
            yield f"row {index}", row
        return
    path = os.fspath(source)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"SFT data {path!r}: no such file")
    if path.endswith(".parquet"):
        import datasets

        for index, row in enumerate(datasets.Dataset.from_parquet(path)):
            yield f"{path} row {index}", row
    elif path.endswith(".json"):
        with open(path, encoding="utf-8") as f:
            rows = json.load(f)
        if not isinstance(rows, list):
            raise ValueError(f"{path}: a .json SFT file holds a list of rows, got {type(rows).__name__}")
        for index, row in enumerate(rows):
            yield f"{path} row {index}", row
    else:
        with open(path, encoding="utf-8") as f:
            for line_number, line in enumerate(f, 1):
                if line.strip():
                    yield f"{path}:{line_number}", json.loads(line)


def assistant_openers(source: str | os.PathLike | Iterable[Mapping[str, Any]]) -> set[str]:
    """The assistant openers of an SFT source's chat rows (``assistant_opener``, '' when a row has none):
    the text a policy trained on them continues from at the start of each assistant turn. Pre-tokenised rows
    say nothing."""
    return {row.get("assistant_opener") or "" for _, row in read_sft_rows(source) if "messages" in row}


def load_sft_sequences(
    source: str | os.PathLike | Iterable[Mapping[str, Any]], tokenizer=None
) -> tuple[list[TokenSequence], int]:
    """Reads SFT examples (see :func:`read_sft_rows` for the sources); returns the sequences and the count of
    rows skipped for having nothing to train on (no assistant turn, fewer than two tokens, or no loss token
    after the first).

    A row is a chat, ``{"messages": [...], "tools": [...]?, "assistant_opener": "<reason>"?}``, rendered with
    ``tokenizer``'s chat template and tokenised the way a rollout builds its token stream
    (``conversation.tokenize_conversation``: loss on the assistant-written tokens only; see
    :func:`_chat_row` for the function-calling variants accepted), or pre-tokenised
    ``{"input_ids": [...], "loss_mask": [...]}``.
    """
    sequences, skipped = [], 0
    for where, row in read_sft_rows(source):
        if "messages" in row:
            if tokenizer is None:
                raise ValueError(f"{where}: chat rows need a tokenizer (config.tokenizer)")
            try:
                messages, tools, opener = _chat_row(row)
                if not any(m["role"] == "assistant" for m in messages):
                    skipped += 1
                    continue
                tokenized = tokenize_conversation(tokenizer, messages, tools=tools, assistant_opener=opener)
            except (ValueError, TypeError, KeyError) as error:
                raise ValueError(f"{where}: {error}") from error
            ids, mask = tokenized.input_ids, tokenized.loss_mask
        elif "input_ids" in row:
            ids, mask = list(row["input_ids"]), row.get("loss_mask")
            if mask is None or len(mask) != len(ids):
                raise ValueError(f"{where}: input_ids needs a loss_mask of the same length")
        else:
            raise ValueError(f"{where}: a row needs 'messages' or 'input_ids', got keys {sorted(row)}")
        if len(ids) < 2 or not any(mask[1:]):
            skipped += 1
            continue
        # The first token has no context to be predicted from.
        sequences.append(TokenSequence(tokens=list(ids), loss_mask=[0, *list(mask)[1:]]))
    return sequences, skipped
