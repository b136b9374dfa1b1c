"""The Qwen-Math chat template, rendered as a plain string.

Rendered by hand (not through a tokenizer's chat template) so the tiny char-level preset and the
real Qwen tokenizers produce byte-identical prompts; a test checks the string against the shared
Qwen2.5-Math tokenizer's own ``apply_chat_template``.
"""

from __future__ import annotations

QWEN_MATH_SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"


def render_prompt(
    problem: str,
    system_prompt: str | None = QWEN_MATH_SYSTEM_PROMPT,
    extra_empty_assistant_turn: bool = False,
) -> str:
    """Return the Qwen-Math prompt for ``problem``, ending where the assistant starts writing.

    ``system_prompt=None`` drops the system turn. ``extra_empty_assistant_turn`` reproduces the
    reference run's data files, whose prompt carried an empty assistant message before the
    generation prompt.
    """
    parts = []
    if system_prompt is not None:
        parts.append(f"{IM_START}system\n{system_prompt}{IM_END}\n")
    parts.append(f"{IM_START}user\n{problem}{IM_END}\n")
    if extra_empty_assistant_turn:
        parts.append(f"{IM_START}assistant\n{IM_END}\n")
    parts.append(f"{IM_START}assistant\n")
    return "".join(parts)
