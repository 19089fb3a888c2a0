"""No copy-paste twins in the code: no run of six significant lines stands in two places of `rstar2jax/`,
`experiments/` or `sandbox_server/` (issue 39). Significant: code other than imports, docstrings, comments,
function signatures and lines of punctuation alone, compared with their indentation stripped. The
`duplicates` tool of the development machine also pairs code of the same shape under other names; this test
is the part of it that is unambiguous, and it runs everywhere."""

import ast
import collections
import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[1]
SOURCE_ROOTS = ("rstar2jax", "experiments", "sandbox_server")
WINDOW = 6


def _docstring_lines(node) -> range:
    first = node.body[0] if getattr(node, "body", None) else None
    value = first.value if isinstance(first, ast.Expr) else None
    if isinstance(value, ast.Constant) and isinstance(value.value, str):
        return range(first.lineno, first.end_lineno + 1)
    return range(0)


def insignificant_lines(tree: ast.Module) -> set[int]:
    """Line numbers of imports, docstrings, decorators and function signatures."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            skip.update(range(node.lineno, node.end_lineno + 1))
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            skip.update(_docstring_lines(node))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            skip.update(range(start, node.body[0].lineno))
    return skip


def significant_lines(source: str) -> list[tuple[int, str]]:
    """(line number, stripped text) of each significant line of ``source``."""
    skip = insignificant_lines(ast.parse(source))
    return [
        (number, text)
        for number, line in enumerate(source.splitlines(), 1)
        if number not in skip and (text := line.strip())
        and not text.startswith("#") and re.search(r"\w", text)
    ]


def twins(sources: dict[str, str]) -> list[tuple[str, int, str, int]]:
    """(file, line, file, line) of each place where ``WINDOW`` significant lines stand again (one row per
    pair of runs: overlapping windows of one run count once)."""
    places = collections.defaultdict(list)
    for name, source in sources.items():
        lines = significant_lines(source)
        for k in range(len(lines) - WINDOW + 1):
            places[tuple(text for _, text in lines[k:k + WINDOW])].append((name, lines[k][0], k))
    rows, seen = [], set()
    for found in places.values():
        for i, (name_a, line_a, k_a) in enumerate(found):
            for name_b, line_b, k_b in found[i + 1:]:
                if name_a == name_b and abs(k_a - k_b) < WINDOW:
                    continue  # a run overlapping itself (a repeated line), not a twin
                run = (name_a, k_a - k_b, name_b)  # windows of one run share their offset
                if run not in seen:
                    seen.add(run)
                    rows.append((name_a, line_a, name_b, line_b))
    return rows


def test_no_six_significant_lines_stand_twice():
    sources = {
        str(path.relative_to(REPO)): path.read_text()
        for root in SOURCE_ROOTS
        for path in sorted((REPO / root).rglob("*.py"))
    }
    found = twins(sources)
    assert not found, "the same lines in two places (share them): " + "; ".join(
        f"{a}:{la} ~ {b}:{lb}" for a, la, b, lb in found
    )


def test_the_twin_check_sees_a_copied_body_and_not_a_shared_signature():
    body = "".join(f"    total = total + values[{i}] * {i}\n" for i in range(6))
    signature = "def {name}(\n    values,\n    a=1,\n    b=2,\n    c=3,\n    d=4,\n    e=5,\n):\n"
    first = signature.format(name="first") + "    total = 0\n" + body + "    return total\n"
    second = signature.format(name="second") + "    return sum(values)\n"
    assert twins({"a.py": first, "b.py": second}) == []  # only the signature is shared
    found = twins({"a.py": first, "b.py": "import os\n\n\ndef third(values):\n    total = 1\n" + body})
    assert [(a, b) for a, _, b, _ in found] == [("a.py", "b.py")]
    # A run repeated inside one file counts too.
    assert len(twins({"a.py": first + "\n\n" + first.replace("first", "other")})) == 1
