"""The hand-rendered Qwen-Math prompt, literally and against the real tokenizer's template."""

from __future__ import annotations

import re

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


# ------------------------------------------------------------------ data.template: the three kinds

from medsrl.data.template import PromptTemplate  # noqa: E402
from medsrl.models.loading import load_tokenizer  # noqa: E402
from reasoning_templates import QWEN3_STYLE, R1_STYLE, tokenizer_dir_with_template  # noqa: E402

R1_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


def test_default_kind_is_the_hand_rendered_prompt_byte_for_byte():
    assert PromptTemplate().render(PROBLEM) == render_prompt(PROBLEM)
    assert PromptTemplate.from_config({"system_prompt": "S.", "extra_empty_assistant_turn": True}).render(
        PROBLEM) == render_prompt(PROBLEM, system_prompt="S.", extra_empty_assistant_turn=True)
    assert PromptTemplate.from_config(None) == PromptTemplate()


def test_instruction_goes_into_the_user_turn_after_a_space():
    t = PromptTemplate(system_prompt=None, instruction="Box it.")
    assert t.render("2+2?") == "<|im_start|>user\n2+2? Box it.<|im_end|>\n<|im_start|>assistant\n"


def test_plain_completion_prompt():
    assert PromptTemplate(kind="plain", system_prompt=None, instruction="Box it.").render("2+2?") == "2+2? Box it.\n"
    assert PromptTemplate(kind="plain", system_prompt="Solve.").render("2+2?") == "Solve.\n\n2+2?\n"


@pytest.mark.parametrize("values, message", [
    ({"kind": "jinja"}, "data.template.kind must be one of 'qwen_math', 'chat', 'plain', got 'jinja'"),
    ({"colour": "red"}, "data.template.colour is not a setting of data.template"),
    ({"kind": "chat", "extra_empty_assistant_turn": True}, "kind=qwen_math only"),
    ({"enable_thinking": True}, "kind=chat only"),
])
def test_bad_settings_are_named(values, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        PromptTemplate.from_config(values)


def test_chat_needs_a_tokenizer_with_a_chat_template():
    from medsrl.models.char_tokenizer import build_char_tokenizer

    with pytest.raises(ValueError, match="no tokenizer given"):
        PromptTemplate(kind="chat").render(PROBLEM)
    with pytest.raises(ValueError, match="has no chat template"):
        PromptTemplate(kind="chat").render(PROBLEM, build_char_tokenizer())


@pytest.mark.shared
def test_chat_kind_with_the_qwen_math_tokenizer_equals_the_hand_rendered_prompt(qwen_tokenizer):
    for system in (QWEN_MATH_SYSTEM_PROMPT, "You are a helpful assistant."):
        assert PromptTemplate(kind="chat", system_prompt=system).render(PROBLEM, qwen_tokenizer) == \
            render_prompt(PROBLEM, system_prompt=system)


@pytest.mark.shared
def test_chat_kind_with_a_think_style_template_from_the_tokenizer_config(tmp_path):
    src = require_shared("tokenizers", "qwen2.5-math")
    tok = load_tokenizer(str(tokenizer_dir_with_template(src, tmp_path / "r1", R1_STYLE)))
    t = PromptTemplate(kind="chat", system_prompt=None, instruction=R1_INSTRUCTION)
    assert t.render(PROBLEM, tok) == f"<｜User｜>{PROBLEM} {R1_INSTRUCTION}<｜Assistant｜><think>\n"


@pytest.mark.shared
def test_enable_thinking_reaches_the_template(tmp_path):
    src = require_shared("tokenizers", "qwen2.5-math")
    tok = load_tokenizer(str(tokenizer_dir_with_template(src, tmp_path / "q3", QWEN3_STYLE)))
    head = f"<|im_start|>user\n{PROBLEM}<|im_end|>\n<|im_start|>assistant\n"
    assert PromptTemplate(kind="chat", system_prompt=None, enable_thinking=True).render(PROBLEM, tok) == head
    assert PromptTemplate(kind="chat", system_prompt=None, enable_thinking=False).render(PROBLEM, tok) == \
        head + "<think>\n\n</think>\n\n"
