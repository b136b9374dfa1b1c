"""The char-level tokenizer of the tiny preset behaves like a Hugging Face tokenizer."""

from __future__ import annotations

from transformers import AutoTokenizer

from medsrl.data.template import ENDOFTEXT, IM_END, IM_START, render_prompt
from medsrl.models.char_tokenizer import build_char_tokenizer


def test_round_trip_of_rendered_prompt_and_response():
    tok = build_char_tokenizer()
    text = render_prompt("What is $\\frac{1}{2} + 3^2$?\nAnswer: {x}") + (
        "We compute 1/2 + 9 = 9.5.\tSo \\boxed{9.5}." + IM_END
    )
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    # every plain character is one token; each special token is one token
    collapsed = text.replace(IM_START, "\x00").replace(IM_END, "\x00")
    assert len(ids) == len(collapsed)
    assert ids.count(1) == text.count(IM_START) > 0
    assert ids.count(2) == text.count(IM_END) > 0


def test_special_tokens_are_single_fixed_ids():
    tok = build_char_tokenizer()
    assert tok(ENDOFTEXT)["input_ids"] == [0]
    assert tok(IM_START)["input_ids"] == [1]
    assert tok(IM_END)["input_ids"] == [2]
    assert tok.pad_token_id == 0
    assert tok.eos_token_id == 2
    assert tok.padding_side == "left"
    assert tok(f"{IM_START}a{IM_END}")["input_ids"] == [1, tok.convert_tokens_to_ids("a"), 2]
    # skipping special tokens drops them from the text
    assert tok.decode([1, tok.convert_tokens_to_ids("a"), 2], skip_special_tokens=True) == "a"


def test_unknown_character_maps_to_unk():
    tok = build_char_tokenizer()
    ids = tok("aé€b")["input_ids"]
    unk = tok.unk_token_id
    assert tok.unk_token == "<unk>"
    assert ids[1] == unk and ids[2] == unk
    assert ids[0] != unk and ids[3] != unk
    assert len(ids) == 4


def test_save_and_reload_with_auto_tokenizer(tmp_path):
    tok = build_char_tokenizer()
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    texts = [render_prompt("2+2?"), "x = 3\n" + IM_END, "€ unknown"]
    for text in texts:
        assert loaded(text)["input_ids"] == tok(text)["input_ids"]
        assert loaded.decode(loaded(text)["input_ids"]) == tok.decode(tok(text)["input_ids"])
    assert loaded.padding_side == "left"
    assert loaded.pad_token_id == 0 and loaded.eos_token_id == 2
    assert len(loaded) == len(tok)
    batch = loaded(["ab", "abcd"], padding=True)
    assert batch["input_ids"][0][:2] == [0, 0]  # left padded with <|endoftext|>
    assert batch["attention_mask"][0] == [0, 0, 1, 1]


def test_a_saved_policy_loads_its_tokenizer_through_auto_tokenizer(tmp_path):
    """Beside a Qwen2 config.json, AutoTokenizer builds Qwen2Tokenizer (a byte-level BPE over
    the saved vocabulary): anyone loading the policy outside medsrl gets the same ids."""
    from medsrl.models.tiny import build_tiny_model

    build_tiny_model(seed=0, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1, intermediate_size=32).save_pretrained(tmp_path)
    tok = build_char_tokenizer()
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert type(loaded).__name__ == "Qwen2Tokenizer"
    text = render_prompt("Start at 4,\tadd 2.\nWhat is it?") + "4 + 2 = 6. \\boxed{6}" + IM_END
    assert loaded(text)["input_ids"] == tok(text)["input_ids"]
    assert loaded.decode(loaded(text)["input_ids"]) == text
    assert loaded.pad_token_id == tok.pad_token_id and loaded.eos_token_id == tok.eos_token_id
    batch = loaded(["ab", "a b c"], padding=True)
    assert batch["input_ids"][0][:3] == [0, 0, 0]  # left padded with <|endoftext|>
