"""Think-style chat templates for tests: a tokenizer config that carries one, as the models with
reasoning ship (DeepSeek-R1-Distill opens ``<think>`` in the generation prompt; Qwen3 reads
``enable_thinking``). Written here, not copied: the shape of those templates, not their text."""

from __future__ import annotations

from pathlib import Path

R1_STYLE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] }}"
    "{% elif m['role'] == 'assistant' %}{{ '<｜Assistant｜>' + m['content'] + '<｜end▁of▁sentence｜>' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜><think>\\n' }}{% endif %}"
)

QWEN3_STYLE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}"
)


def tokenizer_dir_with_template(source: Path, out: Path, template: str) -> Path:
    """A copy of the tokenizer at ``source`` saved to ``out`` with ``template`` as its chat
    template (so it loads through ``load_tokenizer`` like a model's own)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(source))
    tok.chat_template = template
    tok.save_pretrained(str(out))
    return out
