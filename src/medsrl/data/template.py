"""Prompt formats: how a problem becomes the text the policy continues (``data.template.kind``).

``qwen_math`` (the default) renders the Qwen-Math chat template by hand, so the tiny char-level
preset and the real Qwen tokenizers give byte-identical prompts; ``chat`` uses the tokenizer's own
(DeepSeek-R1-Distill, Qwen3); ``plain`` is a completion prompt for base models.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ConfigDict, model_validator

from medsrl.settings import Flag, Settings, Text, nullable, one_of, parse, raise_problems

QWEN_MATH_SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"


def render_prompt(problem: str, system_prompt: str | None = QWEN_MATH_SYSTEM_PROMPT,
                  extra_empty_assistant_turn: bool = False) -> str:
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


class PromptTemplate(Settings):
    """One prompt format (``data.template``); :meth:`render` turns a problem into a prompt."""

    model_config = ConfigDict(frozen=True)

    kind: one_of(TEMPLATE_KINDS) = "qwen_math"
    """qwen_math (hand-rendered ChatML), chat (the tokenizer's chat template) or plain."""
    system_prompt: nullable(Text) = QWEN_MATH_SYSTEM_PROMPT
    """The system turn; null: none."""
    instruction: nullable(Text) = None
    """Appended to the problem in the user turn, after a space."""
    extra_empty_assistant_turn: Flag = False
    """qwen_math: the reference run's data files."""
    enable_thinking: nullable(Flag) = None
    """chat: passed to the template (Qwen3); null: the template's default."""

    @model_validator(mode="after")
    def _kind_settings(self) -> PromptTemplate:
        if self.extra_empty_assistant_turn and self.kind != "qwen_math":
            raise_problems(["data.template.extra_empty_assistant_turn applies to kind=qwen_math only"])
        if self.enable_thinking is not None and self.kind != "chat":
            raise_problems(["data.template.enable_thinking applies to kind=chat only (the tokenizer's template)"])
        return self

    @classmethod
    def from_config(cls, values: Mapping[str, Any] | PromptTemplate | None) -> PromptTemplate:
        return parse(cls, values, "data.template")

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
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
