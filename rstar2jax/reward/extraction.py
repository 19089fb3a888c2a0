"""Final-answer extraction: the last ``\\boxed{}`` inside the final ``<answer>…</answer>`` block.

Pure string functions, cheap enough to run on the event loop. The caller passes only text the model
wrote (never tool outputs), so a ``\\boxed{}`` printed by code cannot become the answer.
"""

from __future__ import annotations

import re

ANSWER_OPEN = "<answer>"
ANSWER_CLOSE = "</answer>"

# \boxed or \fbox as a whole command name (not \boxedfoo).
_BOXED = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
# Argument of a brace-less box ("\boxed 5"): everything up to whitespace, '$' or a brace.
_BARE_ARGUMENT = re.compile(r"[^\s${}]+")
# Integer answers: digits with optional thousands separators (1,000 / 1{,}000 / 1\,000 / 1\!000 in LaTeX).
_INTEGER = re.compile(r"[+-]?(?:\d+|\d{1,3}(?:,\d{3})+)")
_THOUSANDS_SPACING = re.compile(r"\{,\}|\\[,!;: ]")
_COMMA_SPACING = re.compile(r"\s*,\s*")
# "x = 3", "n=3": a plain name on the left of a single '='.
_NAME_EQUALS = re.compile(r"^[A-Za-z][A-Za-z0-9_']*\s*=\s*")


def _braced_argument(text: str, open_at: int) -> int | None:
    """Index one past the '}' matching the '{' at ``open_at`` (escaped ``\\{`` ``\\}`` do not count)."""
    depth = 0
    index = open_at
    while index < len(text):
        char = text[index]
        if char == "\\":
            index += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return index + 1
        index += 1
    return None


def _box_argument(text: str, box: re.Match) -> tuple[str, int] | None:
    """(argument, end index) of the box command ``box``; None when its braces never close."""
    argument_at = box.end()
    while argument_at < len(text) and text[argument_at] == " ":
        argument_at += 1
    if argument_at < len(text) and text[argument_at] == "{":
        end = _braced_argument(text, argument_at)
        return None if end is None else (text[argument_at + 1 : end - 1].strip(), end)
    bare = _BARE_ARGUMENT.match(text, argument_at)
    return (bare.group(), bare.end()) if bare else ("", argument_at)


def last_boxed(text: str) -> str | None:
    """Content of the last top-level ``\\boxed{…}`` (or ``\\boxed x``) in ``text``; nested boxes unwrapped."""
    content = None
    position = 0
    while (box := _BOXED.search(text, position)) is not None:
        parsed = _box_argument(text, box)
        if parsed is None:  # the last box never closes: the final answer is malformed
            return None
        candidate, position = parsed
        content = candidate or content
    while content is not None and (box := _BOXED.match(content)) is not None:
        parsed = _box_argument(content, box)
        if parsed is None or parsed[1] != len(content) or not parsed[0]:
            break
        content = parsed[0]
    return content


def final_answer_block(text: str) -> str | None:
    """Text inside the final ``<answer>…</answer>`` block; None when the last ``<answer>`` is never closed."""
    open_at = text.rfind(ANSWER_OPEN)
    if open_at == -1:
        return None
    close_at = text.find(ANSWER_CLOSE, open_at)
    return None if close_at == -1 else text[open_at + len(ANSWER_OPEN) : close_at]


def extract_answer_with_reason(response_text: str) -> tuple[str | None, str]:
    """Like :func:`extract_answer`, plus why nothing was extracted (or 'extracted')."""
    if not isinstance(response_text, str):
        raise TypeError(f"response_text must be a str, got {type(response_text).__name__}")
    block = final_answer_block(response_text)
    if block is None:
        return None, "no complete <answer>...</answer> block"
    answer = last_boxed(block)
    if answer is None:
        return None, "no \\boxed{} in the final <answer> block"
    return answer, "extracted"


def extract_answer(response_text: str) -> str | None:
    """The last ``\\boxed{}`` content inside the final ``<answer>…</answer>`` block, or None.

    Braces are matched (``\\boxed{\\frac{1}{2}}`` → ``\\frac{1}{2}``), ``\\boxed 5`` and ``\\fbox{}`` are
    understood, a box holding only another box is unwrapped. An ``<answer>`` block that is never closed
    (a truncated response) yields None.
    """
    return extract_answer_with_reason(response_text)[0]


def as_integer(answer: str) -> int | None:
    """The integer an answer string denotes, for the fast path; None when it is not a plain integer.

    Accepts ``$…$`` math delimiters, a leading ``\\$``, a ``name =`` prefix and LaTeX thousands separators
    (``58,500``, ``10,\\!080``, ``1{,}000``). A comma-separated string is read as one integer only in exact
    thousands groups, so ``1,-2`` or ``3, 5, 7`` (lists) are not integers.
    """
    text = answer.strip().strip("$").strip()
    text = _NAME_EQUALS.sub("", text, count=1)
    text = _THOUSANDS_SPACING.sub(lambda m: "," if m.group() == "{,}" else "", text)
    text = _COMMA_SPACING.sub(",", text.removeprefix("\\$"))
    if not _INTEGER.fullmatch(text):
        return None
    return int(text.replace(",", ""))
