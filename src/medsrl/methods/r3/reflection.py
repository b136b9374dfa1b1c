"""In-context self-reflection (ISR): a prompt the policy keeps failing, with one past wrong response
and an instruction to find the mistake, graded against the same answer; its own key keeps its
per-prompt state (MEDS memory) apart.
"""

from __future__ import annotations

from collections.abc import Callable

from medsrl.data.example import Prompt
from medsrl.data.template import render_prompt

REFLECT_SUFFIX = ":reflect"
REFLECTION_SOURCE = "r3_reflection"  # Prompt.source of reflection prompts

DEFAULT_INSTRUCTION = (
    "The attempt above is wrong. Find the mistake, then solve the problem again step by step "
    "and put your final answer within \\boxed{}."
)


def reflection_prompt(prompt: Prompt, wrong_response: str, instruction: str = DEFAULT_INSTRUCTION,
                      render: Callable[[str], str] | None = None) -> Prompt:
    """Rendered by the datamodule's ``render`` (default: the Qwen-Math template)."""
    problem = f"{prompt.problem}\n\nA previous attempt:\n\n{wrong_response.strip()}\n\n{instruction}"
    return Prompt(
        key=prompt.key + REFLECT_SUFFIX,
        text=(render or render_prompt)(problem),
        problem=problem,
        answer=prompt.answer,
        source=REFLECTION_SOURCE,
    )


def is_reflection(prompt: Prompt) -> bool:
    return prompt.source == REFLECTION_SOURCE
