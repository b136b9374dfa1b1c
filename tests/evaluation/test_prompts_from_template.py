"""medsrl-eval renders benchmark problems in the run's prompt format (``template``)."""

from __future__ import annotations

import pytest

from medsrl.data.example import MathExample
from medsrl.data.template import render_prompt
from medsrl.evaluation.responses import problems_from
from medsrl.models.loading import load_tokenizer
from reasoning_templates import R1_STYLE, tokenizer_dir_with_template
from shared_paths import require_shared

EXAMPLES = [MathExample(key="k", problem="What is 2+3?", answer="5", source="t", row=0)]


def test_default_is_the_qwen_math_prompt():
    p = problems_from(EXAMPLES, {"system_prompt": "S."})
    assert p[0].text == render_prompt("What is 2+3?", system_prompt="S.") and p[0].answer == "5"


@pytest.mark.shared
def test_chat_kind_uses_the_models_tokenizer(tmp_path):
    tok = load_tokenizer(str(tokenizer_dir_with_template(
        require_shared("tokenizers", "qwen2.5-math"), tmp_path / "tok", R1_STYLE)))
    p = problems_from(EXAMPLES, {"kind": "chat", "system_prompt": None, "instruction": "Box it."}, tok)
    assert p[0].text == "<｜User｜>What is 2+3? Box it.<｜Assistant｜><think>\n"
