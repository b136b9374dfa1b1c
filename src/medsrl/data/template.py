"""Prompt formats: how a problem becomes the text the policy continues (``data.template``).

Three kinds, chosen by ``data.template.kind``:

- ``qwen_math`` (the default): the Qwen-Math chat template rendered by hand, so the tiny
  char-level preset and the real Qwen tokenizers produce byte-identical prompts; a test checks
  the string against the shared Qwen2.5-Math tokenizer's own ``apply_chat_template``.
- ``chat``: the tokenizer's own chat template (``apply_chat_template``), for models whose prompt
  format is not Qwen-Math ChatML: DeepSeek-R1-Distill (its template opens ``<think>``), Qwen3 with
  ``enable_thinking``.
- ``plain``: a completion prompt without chat markup, for base models.

``instruction`` is appended to the problem in the user turn (DeepScaleR's way of asking for a
boxed answer); ``system_prompt`` is the system turn (Qwen-Math's way), or the first paragraph of
a plain prompt.
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

    def user_turn(self, problem: str) -> str:
        return problem if self.instruction is None else f"{problem} {self.instruction}"

    def render(self, problem: str, tokenizer: Any = None) -> str:
        """The prompt for ``problem``, ending where the model starts writing. ``kind=chat`` needs
        the ``tokenizer`` whose chat template renders it."""
        user = self.user_turn(problem)
        if self.kind == "qwen_math":
            return render_prompt(user, self.system_prompt, self.extra_empty_assistant_turn)
        if self.kind == "plain":
            head = "" if self.system_prompt is None else f"{self.system_prompt}\n\n"
            return f"{head}{user}\n"
        return render_chat(user, tokenizer, self.system_prompt, self.enable_thinking)


def render_chat(user: str, tokenizer: Any, system_prompt: str | None = None,
                enable_thinking: bool | None = None) -> str:
    """``tokenizer.apply_chat_template`` of a system turn (when given) and the user turn, with the
    generation prompt. ``enable_thinking`` reaches the template only when set (Qwen3 reads it)."""
    if tokenizer is None:
        raise ValueError("data.template.kind=chat renders with the tokenizer's chat template: no tokenizer given")
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ValueError(
            f"data.template.kind=chat: tokenizer {name!r} has no chat template; use "
            "data.template.kind=qwen_math or plain, or a tokenizer that ships one"
        )
    messages = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
    messages.append({"role": "user", "content": user})
    extra = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
