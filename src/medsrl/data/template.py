"""Prompt formats: how a problem becomes the text the policy continues (``data.template.kind``).

- ``qwen_math`` (the default): the Qwen-Math chat template rendered by hand, so the tiny
  char-level preset and the real Qwen tokenizers produce byte-identical prompts (a test checks).
- ``chat``: the tokenizer's own chat template, for models whose format is not Qwen-Math ChatML
  (DeepSeek-R1-Distill, whose template opens ``<think>``; Qwen3 with ``enable_thinking``).
- ``plain``: a completion prompt without chat markup, for base models.

``instruction`` follows the problem in the user turn (DeepScaleR's way of asking for a boxed
answer); ``system_prompt`` is the system turn (Qwen-Math's way), or a plain prompt's first
paragraph.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

QWEN_MATH_SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"


def render_prompt(
    problem: str,
    system_prompt: str | None = QWEN_MATH_SYSTEM_PROMPT,
    extra_empty_assistant_turn: bool = False,
) -> str:
    """The Qwen-Math prompt for ``problem``, ending where the assistant starts writing
    (``extra_empty_assistant_turn``: as the reference run's data files, an empty one before)."""
    parts = []
    if system_prompt is not None:
        parts.append(f"{IM_START}system\n{system_prompt}{IM_END}\n")
    parts.append(f"{IM_START}user\n{problem}{IM_END}\n")
    if extra_empty_assistant_turn:
        parts.append(f"{IM_START}assistant\n{IM_END}\n")
    parts.append(f"{IM_START}assistant\n")
    return "".join(parts)


TEMPLATE_KINDS = ("qwen_math", "chat", "plain")


@dataclass(frozen=True)
class PromptTemplate:
    """One prompt format (``data.template``); :meth:`render` turns a problem into a prompt."""

    kind: str = "qwen_math"
    system_prompt: str | None = QWEN_MATH_SYSTEM_PROMPT
    instruction: str | None = None  # appended to the problem, after a space
    extra_empty_assistant_turn: bool = False  # qwen_math: the reference run's data files
    enable_thinking: bool | None = None  # chat: passed to the template (Qwen3); None: its default

    def __post_init__(self) -> None:
        if self.kind not in TEMPLATE_KINDS:
            raise ValueError(f"data.template.kind={self.kind!r}; valid: {', '.join(TEMPLATE_KINDS)}")
        if self.extra_empty_assistant_turn and self.kind != "qwen_math":
            raise ValueError("data.template.extra_empty_assistant_turn applies to kind=qwen_math only")
        if self.enable_thinking is not None and self.kind != "chat":
            raise ValueError("data.template.enable_thinking applies to kind=chat only (the tokenizer's template)")

    @classmethod
    def from_config(cls, values: Mapping[str, Any] | PromptTemplate | None) -> PromptTemplate:
        """From ``data.template`` (a mapping; unknown keys are an error naming the allowed ones)."""
        if isinstance(values, PromptTemplate):
            return values
        values = dict(values or {})
        allowed = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - allowed)
        if unknown:
            raise ValueError(f"data.template: unknown keys {unknown} (allowed: {sorted(allowed)})")
        return cls(**values)

    def render(self, problem: str, tokenizer: Any = None) -> str:
        """The prompt for ``problem``, ending where the model starts writing. ``kind=chat`` needs
        the ``tokenizer`` whose chat template renders it."""
        user = problem if self.instruction is None else f"{problem} {self.instruction}"
        system_prompt = self.system_prompt
        if self.kind == "qwen_math":
            return render_prompt(user, system_prompt, self.extra_empty_assistant_turn)
        if self.kind == "plain":
            return user + "\n" if system_prompt is None else f"{system_prompt}\n\n{user}\n"
        if tokenizer is None:
            raise ValueError("data.template.kind=chat renders with the tokenizer's chat template: "
                             "no tokenizer given")
        if not getattr(tokenizer, "chat_template", None):
            name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
            raise ValueError(
                f"data.template.kind=chat: tokenizer {name!r} has no chat template; use "
                "data.template.kind=qwen_math or plain, or a tokenizer that ships one"
            )
        messages = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
        messages.append({"role": "user", "content": user})
        # set only when given: Qwen3's template reads it
        extra = {} if self.enable_thinking is None else {"enable_thinking": self.enable_thinking}
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **extra
        )
