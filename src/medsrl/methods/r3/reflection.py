"""In-context self-reflection (ISR): a second chance at a prompt the policy keeps failing.

The reflection prompt shows the problem, one past wrong response and an instruction to find the
mistake, graded against the same answer. Its key gets ``REFLECT_SUFFIX``: its per-prompt state
(MEDS memory) is apart from the original's."""

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
    """``prompt``'s reflection prompt, rendered in the data's prompt format (``render``: the
    datamodule's ``render``; the Qwen-Math template by default)."""
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
