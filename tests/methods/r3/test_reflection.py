"""The reflection prompt, as the policy sees it."""

from medsrl.data.example import Prompt
from medsrl.data.template import PromptTemplate
from medsrl.methods.r3.reflection import DEFAULT_INSTRUCTION, is_reflection, reflection_prompt

ORIGINAL = Prompt(key="abc123", text="(rendered)", problem="What is 2 + 3?", answer="5", source="arith")


def test_reflection_prompt_text_in_the_qwen_math_template():
    p = reflection_prompt(ORIGINAL, "2 + 3 = 6.\n\\boxed{6}\n", "Fix it.",
                          PromptTemplate(system_prompt="Reason.").render)
    assert p.problem == "What is 2 + 3?\n\nA previous attempt:\n\n2 + 3 = 6.\n\\boxed{6}\n\nFix it."
    assert p.text == (
        "<|im_start|>system\nReason.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 3?\n\nA previous attempt:\n\n2 + 3 = 6.\n\\boxed{6}\n\nFix it.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert p.answer == "5"  # graded against the same answer
    assert p.key == "abc123:reflect"
    assert is_reflection(p) and not is_reflection(ORIGINAL)


def test_default_template_and_instruction():
    p = reflection_prompt(ORIGINAL, "wrong")
    assert p.text.startswith("<|im_start|>system\nPlease reason step by step")
    assert p.problem.endswith(DEFAULT_INSTRUCTION)
    assert "\\boxed{}" in DEFAULT_INSTRUCTION
