"""In-context self-reflection (ISR): a second chance at a prompt the policy keeps failing.

The reflection prompt shows the problem, one past wrong response and an instruction to find the
mistake and solve again; it is graded against the same answer and trained on as its own group.
Its key is the original key with ``REFLECT_SUFFIX`` so its per-prompt state (MEDS memory) stays
apart from the original's, and is shared by every reflection on the same problem.
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


def reflection_problem(problem: str, wrong_response: str, instruction: str = DEFAULT_INSTRUCTION) -> str:
    """The user turn of a reflection prompt."""
    return f"{problem}\n\nA previous attempt:\n\n{wrong_response.strip()}\n\n{instruction}"


def reflection_prompt(prompt: Prompt, wrong_response: str, instruction: str = DEFAULT_INSTRUCTION,
                      render: Callable[[str], str] | None = None) -> Prompt:
    """``prompt``'s reflection prompt, rendered in the data's prompt format (``render``: the
    datamodule's ``render``; the Qwen-Math template by default)."""
    problem = reflection_problem(prompt.problem, wrong_response, instruction)
    return Prompt(
        key=prompt.key + REFLECT_SUFFIX,
        text=(render or render_prompt)(problem),
        problem=problem,
        answer=prompt.answer,
        source=REFLECTION_SOURCE,
    )


def is_reflection(prompt: Prompt) -> bool:
    return prompt.source == REFLECTION_SOURCE
