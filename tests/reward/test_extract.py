"""Boxed-answer extraction: the last box wins, braces nest, truncated boxes give no answer."""

from __future__ import annotations

import pytest

from medsrl.reward.extract import extract_last_boxed


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The answer is $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),
        (
            "nested \\boxed{\\left\\{ 1, \\frac{2}{\\sqrt{3}} \\right\\}} done",
            "\\left\\{ 1, \\frac{2}{\\sqrt{3}} \\right\\}",
        ),
        ("first \\boxed{3}, then corrected: \\boxed{4}", "4"),
        ("\\boxed{1}\n\\fbox{2}", "2"),
        ("\\fbox{x=5}", "x=5"),
        ("so $\\boxed 5$.", "5"),
        ("\\boxed 7\nmore text", "7"),
        ("\\boxed {12}", "12"),
        (
            "\\boxed{\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}}",
            "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}",
        ),
        ("empty box \\boxed{}", ""),
    ],
)
def test_extracts_last_box(text: str, expected: str) -> None:
    assert extract_last_boxed(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "no box here, the answer is 5",
        "",
        "truncated at the length limit: \\boxed{\\frac{1}{2}",
        "an earlier box \\boxed{3} does not rescue a truncated last one \\boxed{4",
        "\\boxedx{3}",  # a different macro, not a box
        "\\boxed",
    ],
)
def test_no_answer(text: str) -> None:
    assert extract_last_boxed(text) is None
