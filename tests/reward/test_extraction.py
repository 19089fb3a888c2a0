"""Answer extraction (last \\boxed{} of the final <answer> block) and the integer fast path's parser."""

import pytest

from rstar2jax.reward import as_integer, extract_answer
from rstar2jax.reward.extraction import extract_answer_with_reason


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<reason>r</reason>\n<answer>The answer is $\\boxed{42}$.</answer>", "42"),
        ("<answer>\\boxed{\\frac{1}{2}}</answer>", "\\frac{1}{2}"),
        (
            "<answer>\\boxed{ \\left( 3, \\frac{\\pi}{2} \\right) }</answer>",
            "\\left( 3, \\frac{\\pi}{2} \\right)",
        ),
        # The last box of the block wins.
        ("<answer>\\boxed{1} or rather \\boxed{2}</answer>", "2"),
        # Only the final <answer> block counts; boxes in the reasoning are ignored.
        ("<reason>\\boxed{7}</reason><answer>\\boxed{1}</answer> wait <answer>\\boxed{5}</answer>", "5"),
        # Brace-less forms.
        ("<answer>\\boxed 12 apples</answer>", "12"),
        ("<answer>$\\boxed5$</answer>", "5"),
        ("<answer>\\fbox{8}</answer>", "8"),
        # Escaped braces do not close the box.
        ("<answer>\\boxed{\\{1, 2\\}}</answer>", "\\{1, 2\\}"),
        # A box holding only a box is unwrapped; an empty box does not hide an earlier one.
        ("<answer>\\boxed{\\boxed{9}}</answer>", "9"),
        ("<answer>\\boxed{3} \\boxed{}</answer>", "3"),
        ("<answer>\\boxed{\\boxed{1} + 1}</answer>", "\\boxed{1} + 1"),
        # \boxedsymbol is another command, not \boxed.
        ("<answer>\\boxedfoo{3}</answer>", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    "text, reason",
    [
        ("The answer is \\boxed{42}.", "no complete <answer>...</answer> block"),
        # The final <answer> is never closed (truncated response): no answer, even after a complete block.
        ("<answer>\\boxed{1}</answer> more <answer>\\boxed{2}", "no complete <answer>...</answer> block"),
        ("<answer>42</answer>", "no \\boxed{} in the final <answer> block"),
        ("<answer>\\boxed{}</answer>", "no \\boxed{} in the final <answer> block"),
        ("<answer>\\boxed{\\frac{1}{2}</answer>", "no \\boxed{} in the final <answer> block"),
        ("<answer>\\boxed{1} or \\boxed{2</answer>", "no \\boxed{} in the final <answer> block"),
    ],
)
def test_no_answer_reasons(text, reason):
    assert extract_answer_with_reason(text) == (None, reason)


def test_extract_answer_rejects_non_text():
    with pytest.raises(TypeError, match="response_text must be a str"):
        extract_answer(b"<answer>\\boxed{1}</answer>")


@pytest.mark.parametrize(
    "text, expected",
    [
        ("42", 42),
        ("-7", -7),
        ("+3", 3),
        ("025", 25),
        ("$204$", 204),
        ("x = 3", 3),
        ("n=17", 17),
        ("58,500", 58500),
        ("10,\\!080", 10080),
        ("11,\\! 111,\\! 111,\\! 100", 11111111100),
        ("1{,}000", 1000),
        ("1\\,000", 1000),
        ("\\$32,\\!348", 32348),
        # Not plain integers: lists, decimals, expressions, bases, units.
        ("1,-2", None),
        ("3, 5, 7", None),
        ("1,00", None),
        ("5.0", None),
        ("\\frac{10}{2}", None),
        ("52_8", None),
        ("30^\\circ", None),
        ("2x", None),
        ("x = y = 3", None),
        ("", None),
    ],
)
def test_as_integer(text, expected):
    assert as_integer(text) == expected
