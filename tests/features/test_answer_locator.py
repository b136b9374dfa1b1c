"""Answer position: the token holding the ``{`` of the last ``\\boxed{`` (docs/REFERENCE.md step 1)."""

from __future__ import annotations

import random
import time

import pytest
import torch

from medsrl.features.answer_locator import locate_answers, token_pieces
from medsrl.models.char_tokenizer import build_char_tokenizer
from medsrl.models.loading import load_tokenizer
from shared_paths import require_shared


@pytest.fixture(scope="module")
def char_tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def qwen_tok():
    return load_tokenizer(str(require_shared("tokenizers", "qwen2.5-math")))


def enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def locate_answer(ids, tok, **kwargs) -> int | None:
    return locate_answers([ids], tok, **kwargs)[0]


# ---------------------------------------------------------------- char tokenizer (1 char = 1 token)


def test_char_one_box(char_tok):
    text = "so x = \\boxed{42}."
    assert locate_answer(enc(char_tok, text), char_tok) == text.index("{")


def test_char_two_boxes_takes_last(char_tok):
    text = "first \\boxed{1} then \\boxed{2}"
    assert locate_answer(enc(char_tok, text), char_tok) == text.rindex("{")


def test_char_no_box(char_tok):
    assert locate_answer(enc(char_tok, "the answer is 42 {x}"), char_tok) is None
    assert locate_answer([], char_tok) is None


def test_char_fallback_boxed_without_brace(char_tok):
    # "\boxed {7}": no exact "\boxed{", last "boxed" then the first "{" within 10 tokens.
    text = "so \\boxed {7}"
    assert locate_answer(enc(char_tok, text), char_tok) == text.index("{")
    # The brace too far after "boxed": no answer.
    far = "so \\boxed" + " " * 20 + "{7}"
    assert locate_answer(enc(char_tok, far), char_tok) is None
    assert locate_answer(enc(char_tok, far), char_tok, fallback_window=30) == far.index("{")
    # "boxed" with no brace after it at all.
    assert locate_answer(enc(char_tok, "{1} \\boxed 7"), char_tok) is None


def test_char_exact_match_beats_later_bare_boxed(char_tok):
    text = "\\boxed{3} and boxed {9}"
    assert locate_answer(enc(char_tok, text), char_tok) == text.index("{")


def test_char_unbalanced_and_truncated(char_tok):
    text = "\\boxed{1} ... \\boxed{12"  # truncated: no closing brace
    assert locate_answer(enc(char_tok, text), char_tok) == text.rindex("{")
    end = "text \\boxed{"  # "{" is the last token
    assert locate_answer(enc(char_tok, end), char_tok) == len(end) - 1


def test_char_box_far_from_end(char_tok):
    # The backwards scan widens its window until it finds the box.
    text = "a \\boxed{5}" + "x" * 1000
    assert locate_answer(enc(char_tok, text), char_tok) == text.index("{")
    text2 = "\\boxed{1}" + "y" * 300 + "\\boxed{2}" + "z" * 70
    assert locate_answer(enc(char_tok, text2), char_tok) == text2.rindex("{")


def test_char_box_straddles_window_edge(char_tok):
    # "\boxed{" starting just before the first 64-token window must still be found.
    for tail in range(55, 70):
        text = "pre \\boxed{" + "w" * tail
        assert locate_answer(enc(char_tok, text), char_tok) == text.index("{"), tail


def test_accepts_tensors_and_batch(char_tok):
    texts = ["\\boxed{1}", "none", "x \\boxed {2}", "\\boxed{3}\\boxed{4}"]
    ids = [enc(char_tok, t) for t in texts]
    expected = [6, None, 9, 15]
    assert locate_answers(ids, char_tok) == expected
    assert locate_answer(torch.tensor(ids[0]), char_tok) == 6


def test_batch_is_fast(char_tok):
    rng = random.Random(0)
    alphabet = "abcdefghij0123456789 +-=()\n"
    responses = []
    for i in range(128):
        body = "".join(rng.choice(alphabet) for _ in range(190))
        text = body + ("\\boxed{7}" if i % 4 else "")
        responses.append(enc(char_tok, text[:200]))
    locate_answers(responses, char_tok)  # warm the piece cache
    t0 = time.perf_counter()
    for _ in range(5):
        out = locate_answers(responses, char_tok)
    per_call = (time.perf_counter() - t0) / 5
    assert sum(o is not None for o in out) == 96
    # Measured ~2-4 ms; the bound is loose so a busy machine does not fail it.
    assert per_call < 0.2, per_call


# ---------------------------------------------------------------- the real Qwen2.5-Math tokenizer

REAL_RESPONSES = [
    "We simplify: $\\frac{2}{4} = \\frac{1}{2}$, so the answer is $\\boxed{\\frac{1}{2}}$.",
    "\\boxed{025}",
    "Thus \\(\\boxed{x=3}\\)",
    "{\\boxed{5}}",
    "The boxed answer format is required. Computing, 3+4=7. Final: \\boxed{7}",
    "First try \\boxed{12} was wrong; the correct value is \\boxed{-12}.",
    "Les réponses: 5 €. Donc $\\boxed{5\\text{ €}}$",
    "Answer:\n\\[\n\\boxed{\\dfrac{\\sqrt{3}}{2}}\n\\]",
    "so \\boxed {7}",
    "So the final answer is:\n\\boxed{100}<|im_end|>",
    "\\boxed{\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}}",
]


@pytest.mark.shared
@pytest.mark.parametrize("text", REAL_RESPONSES)
def test_qwen_real_responses(qwen_tok, text):
    ids = enc(qwen_tok, text)
    idx = locate_answer(ids, qwen_tok)
    assert idx is not None
    decoded = qwen_tok.decode(ids, skip_special_tokens=False)
    assert decoded == text  # byte-level BPE round-trips
    # The character index of the "{" of the last box in the text.
    k = decoded.rfind("\\boxed{")
    brace = k + len("\\boxed") if k >= 0 else decoded.index("{", decoded.rfind("boxed"))
    assert decoded[brace] == "{"
    before = qwen_tok.decode(ids[:idx], skip_special_tokens=False)
    upto = qwen_tok.decode(ids[: idx + 1], skip_special_tokens=False)
    assert len(before) <= brace < len(upto), (qwen_tok.convert_ids_to_tokens(ids), idx)
    assert "{" in qwen_tok.decode([ids[idx]])


@pytest.mark.shared
def test_qwen_split_variants(qwen_tok):
    """The splits the docstring names really occur, and each is located."""
    cases = {
        "\\boxed{025}": ["\\", "boxed", "{"],
        " $\\boxed{\\frac{1}{2}}$": ["Ġ$\\", "boxed", "{\\"],
        "Thus \\(\\boxed{x=3}\\)": ["(\\", "boxed", "{x"],
        "{\\boxed{5}}": ["{\\", "boxed", "{"],
    }
    for text, must_contain in cases.items():
        ids = enc(qwen_tok, text)
        toks = qwen_tok.convert_ids_to_tokens(ids)
        for piece in must_contain:
            assert piece in toks, (text, toks)
        idx = locate_answer(ids, qwen_tok)
        assert toks[idx] == must_contain[-1], (text, toks, idx)


@pytest.mark.shared
def test_qwen_no_box_and_batch(qwen_tok):
    texts = ["The answer is 5.", "\\boxed{3}", "boxed in {a} corner"]
    ids = [enc(qwen_tok, t) for t in texts]
    out = locate_answers(ids, qwen_tok)
    assert out[0] is None
    assert qwen_tok.convert_ids_to_tokens(ids[1])[out[1]] == "{"
    # "boxed" then "{" within 10 tokens: the reference fallback accepts it.
    assert "{" in qwen_tok.decode([ids[2][out[2]]])
    assert token_pieces(qwen_tok) is token_pieces(qwen_tok)  # one shared cache per tokenizer


# ---------------------------------------------------------------- reasoning models (grader.reasoning_end)


def test_char_box_inside_the_reasoning_is_not_the_answer(char_tok):
    text = "<think>x=\\boxed{3}</think>so \\boxed{5}"
    ids = enc(char_tok, text)
    assert locate_answer(ids, char_tok) == text.rindex("{")
    assert locate_answer(ids, char_tok, reasoning_end="</think>") == text.rindex("{")
    only_inside = "<think>x=\\boxed{3}</think>so 5"
    assert locate_answer(enc(char_tok, only_inside), char_tok) == only_inside.index("{")
    assert locate_answer(enc(char_tok, only_inside), char_tok, reasoning_end="</think>") is None
    unclosed = "<think>x=\\boxed{3}"
    assert locate_answer(enc(char_tok, unclosed), char_tok, reasoning_end="</think>") is None
    batch = [enc(char_tok, t) for t in (text, only_inside, unclosed)]
    assert locate_answers(batch, char_tok, reasoning_end="</think>") == [text.rindex("{"), None, None]


@pytest.mark.shared
def test_qwen_box_after_the_reasoning(qwen_tok):
    text = "<think>\nmaybe \\boxed{12}\n</think>\n\nThe answer is $\\boxed{13}$."
    ids = enc(qwen_tok, text)
    i = locate_answer(ids, qwen_tok, reasoning_end="</think>")
    assert i is not None and qwen_tok.decode(ids[i + 1 :]).startswith("13")
    inside_only = enc(qwen_tok, "<think>\nmaybe \\boxed{12}\n</think>\n\nNo idea.")
    assert locate_answer(inside_only, qwen_tok, reasoning_end="</think>") is None
