"""The hand-rendered Qwen-Math prompt, literally and against the real tokenizer's template."""

from __future__ import annotations

import pytest

from medsrl.data.template import QWEN_MATH_SYSTEM_PROMPT, render_prompt
from shared_paths import require_shared

PROBLEM = "What is $1+1$?"


def test_default_prompt_exact_string():
    assert render_prompt(PROBLEM) == (
        "<|im_start|>system\n"
        "Please reason step by step, and put your final answer within \\boxed{}.<|im_end|>\n"
        "<|im_start|>user\n"
        "What is $1+1$?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_system_prompt_constant():
    assert QWEN_MATH_SYSTEM_PROMPT == (
        "Please reason step by step, and put your final answer within \\boxed{}."
    )


def test_no_system_prompt():
    assert render_prompt(PROBLEM, system_prompt=None) == (
        "<|im_start|>user\nWhat is $1+1$?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_custom_system_prompt():
    assert render_prompt("2+2?", system_prompt="You are a helpful assistant.") == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_extra_empty_assistant_turn():
    assert render_prompt(PROBLEM, extra_empty_assistant_turn=True) == (
        "<|im_start|>system\n"
        "Please reason step by step, and put your final answer within \\boxed{}.<|im_end|>\n"
        "<|im_start|>user\n"
        "What is $1+1$?<|im_end|>\n"
        "<|im_start|>assistant\n<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_multiline_problem_kept_verbatim():
    problem = "Line one.\n\nLine two with \\frac{1}{2} and {braces}."
    text = render_prompt(problem, system_prompt=None)
    assert text == f"<|im_start|>user\n{problem}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def qwen_tokenizer():
    transformers = pytest.importorskip("transformers")
    path = require_shared("tokenizers", "qwen2.5-math")
    return transformers.AutoTokenizer.from_pretrained(str(path))


@pytest.mark.shared
@pytest.mark.parametrize(
    "problem",
    [
        PROBLEM,
        "Let $f(x) = \\left\\{\n\\begin{array}{cl} ax+3 \\end{array}\\right.$ Find $a$.",
        "Janet’s ducks lay 16 eggs per day.",
    ],
)
@pytest.mark.parametrize("system", [QWEN_MATH_SYSTEM_PROMPT, "You are a helpful assistant."])
def test_matches_qwen_chat_template(qwen_tokenizer, problem, system):
    messages = [{"role": "system", "content": system}, {"role": "user", "content": problem}]
    expected = qwen_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert render_prompt(problem, system_prompt=system) == expected


@pytest.mark.shared
def test_extra_turn_matches_qwen_chat_template(qwen_tokenizer):
    messages = [
        {"role": "system", "content": QWEN_MATH_SYSTEM_PROMPT},
        {"role": "user", "content": PROBLEM},
        {"role": "assistant", "content": ""},
    ]
    expected = qwen_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert render_prompt(PROBLEM, extra_empty_assistant_turn=True) == expected
