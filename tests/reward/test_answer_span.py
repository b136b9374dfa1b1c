"""The answer span of a reasoning model's response: the text after the last ``</think>``."""

from __future__ import annotations

import pytest

from medsrl.models.char_tokenizer import build_char_tokenizer
from medsrl.models.loading import load_tokenizer
from medsrl.reward.answer_span import (
    THINK_END,
    answer_start,
    answer_starts,
    answer_text,
    token_pieces,
)
from shared_paths import require_shared


def test_answer_text():
    assert answer_text("all of it", None) == "all of it"
    assert answer_text("<think>a</think> b", THINK_END) == " b"
    assert answer_text("a</think>b</think>c", THINK_END) == "c"  # the last one closes the reasoning
    assert answer_text("<think>never closed \\boxed{1}", THINK_END) is None
    assert answer_text("done</think>", THINK_END) == ""


def _text_from(tok, ids, start):
    return tok.decode(ids[start:], skip_special_tokens=False)


def test_char_tokens():
    tok = build_char_tokenizer()
    ids = tok.encode("ab</think>cd", add_special_tokens=False)
    assert answer_start(ids, token_pieces(tok), THINK_END) == 10
    assert answer_start(ids, token_pieces(tok), None) == 0
    assert answer_starts([ids, ids[:5]], tok, THINK_END) == [10, None]


@pytest.fixture(scope="module")
def qwen_tok():
    return load_tokenizer(str(require_shared("tokenizers", "qwen2.5-math")))


@pytest.mark.shared
@pytest.mark.parametrize("text, answer", [
    ("<think>\nx = \\boxed{3}?\n</think>\n\nSo \\boxed{5}.", "\n\nSo \\boxed{5}."),
    ("I think</think>\\boxed{7}", "\\boxed{7}"),
    ("a</think>b</think>\n\\boxed{9}", "\n\\boxed{9}"),
])
def test_qwen_tokens_split_the_tag(qwen_tok, text, answer):
    """``</think>`` is no special token of Qwen2.5-Math: BPE splits it (and may merge its ``>``
    with what follows); the span starts at the token holding the first answer character."""
    ids = qwen_tok.encode(text, add_special_tokens=False)
    start = answer_start(ids, token_pieces(qwen_tok), THINK_END)
    decoded = _text_from(qwen_tok, ids, start)
    assert decoded.endswith(answer) and len(decoded) - len(answer) < len(THINK_END)
    assert THINK_END not in decoded


@pytest.mark.shared
def test_qwen_tag_as_one_special_token(tmp_path):
    """As in R1-Distill's and Qwen3's tokenizers, where ``</think>`` is one added token."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(require_shared("tokenizers", "qwen2.5-math")))
    tok.add_special_tokens({"additional_special_tokens": ["<think>", THINK_END]})
    ids = tok.encode("<think>\nhm \\boxed{1}</think>\n\\boxed{2}", add_special_tokens=False)
    end = tok.convert_tokens_to_ids(THINK_END)
    assert answer_start(ids, token_pieces(tok), THINK_END) == ids.index(end) + 1
    assert answer_start(ids[: ids.index(end)], token_pieces(tok), THINK_END) is None
