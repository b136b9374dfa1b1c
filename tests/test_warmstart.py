"""Tests for the cached supervised warm start (micro configs, so they run in seconds)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from medsrl import warmstart
from medsrl.data.arithmetic import generate_arithmetic
from medsrl.data.template import QWEN_MATH_SYSTEM_PROMPT
from medsrl.models.char_tokenizer import build_char_tokenizer
from medsrl.models.settings import WarmStartConfig
from medsrl.models.tiny import build_tiny_model
from medsrl.reward.grader import MathGrader
from medsrl.warmstart import (
    collate,
    encode_examples,
    ensure_warm_start,
    sequence_loss,
    warm_start_dir,
)

MICRO_MODEL = {
    "hidden_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "intermediate_size": 64,
}


def micro_ws(**overrides) -> WarmStartConfig:
    base = dict(
        steps=3,
        batch_size=4,
        warmup_steps=1,
        num_examples=32,
        eval_examples=4,
        eval_max_new_tokens=8,
    )
    base.update(overrides)
    return WarmStartConfig(**base)


def entries(root) -> list[str]:
    """What a cache directory holds besides the writers' lock files."""
    return sorted(p.name for p in root.iterdir() if not p.name.endswith(".lock"))


@pytest.fixture
def count_training(monkeypatch):
    calls = []
    original = warmstart.train_model

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(warmstart, "train_model", counting)
    return calls


def test_creates_loadable_dir_and_reuses_it(tmp_path, count_training):
    ws = micro_ws()
    path = ensure_warm_start(tmp_path, MICRO_MODEL, ws, log_every=1, num_threads=1)
    assert path == warm_start_dir(tmp_path, MICRO_MODEL, ws)
    assert path.parent == tmp_path and len(path.name) == 12
    assert count_training == [1]

    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert model.config.hidden_size == 32 and model.config.num_hidden_layers == 1
    assert tok.pad_token_id == 0 and tok.eos_token_id == 2 and tok.padding_side == "left"
    assert (
        tok("<|im_start|>ab")["input_ids"] == build_char_tokenizer()("<|im_start|>ab")["input_ids"]
    )

    metrics = json.loads((path / "metrics.json").read_text())
    assert [e["step"] for e in metrics["loss_curve"]] == [1, 2, 3]
    assert 0.0 <= metrics["val_sampled_accuracy"] <= 1.0
    assert 0.0 <= metrics["val_greedy_accuracy"] <= 1.0
    assert metrics["wall_s"] > 0

    mtime = (path / "metrics.json").stat().st_mtime_ns
    again = ensure_warm_start(tmp_path, MICRO_MODEL, ws, log_every=1, num_threads=1)
    assert again == path
    assert count_training == [1]  # not retrained
    assert (path / "metrics.json").stat().st_mtime_ns == mtime
    assert entries(tmp_path) == [path.name]  # no temp dirs left behind


def test_changed_config_changes_dir(tmp_path):
    base = warm_start_dir(tmp_path, MICRO_MODEL, micro_ws())
    assert warm_start_dir(tmp_path, MICRO_MODEL, micro_ws()) == base
    assert warm_start_dir(tmp_path, MICRO_MODEL, micro_ws(steps=4)) != base
    assert warm_start_dir(tmp_path, MICRO_MODEL, micro_ws(level=2)) != base
    assert warm_start_dir(tmp_path, MICRO_MODEL, micro_ws(system_prompt=None)) != base
    assert warm_start_dir(tmp_path, {**MICRO_MODEL, "hidden_size": 64}, micro_ws()) != base
    # Spelling out a default of the tiny config does not change the entry.
    assert (
        warm_start_dir(tmp_path, {**MICRO_MODEL, "max_position_embeddings": 1024}, micro_ws())
        == base
    )


def test_crash_leaves_no_cache_entry(tmp_path, monkeypatch):
    calls = []
    original = warmstart.sequence_loss

    def crashing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("simulated crash")
        return original(*args, **kwargs)

    monkeypatch.setattr(warmstart, "sequence_loss", crashing)
    ws = micro_ws()
    with pytest.raises(RuntimeError, match="simulated crash"):
        ensure_warm_start(tmp_path, MICRO_MODEL, ws, num_threads=1)
    assert len(calls) == 2
    assert entries(tmp_path) == []
    assert not warm_start_dir(tmp_path, MICRO_MODEL, ws).exists()


# A writer in its own process that says when it starts training, then takes its time.
WRITER = """
import json, sys, time
from medsrl import warmstart
train = warmstart.train_model
def slow(*args, **kwargs):
    print("building", flush=True)
    time.sleep(2)
    return train(*args, **kwargs)
warmstart.train_model = slow
ws = warmstart.WarmStartConfig(**json.loads(sys.argv[3]))
print(warmstart.ensure_warm_start(sys.argv[1], json.loads(sys.argv[2]), ws, num_threads=1))
"""


@pytest.mark.slow
def test_concurrent_writers_build_one_entry(tmp_path, count_training):
    """A second writer asking while the first builds waits for it and reuses its entry."""
    ws = micro_ws()
    args = [str(tmp_path), json.dumps(MICRO_MODEL), json.dumps(ws.__dict__)]
    first = subprocess.Popen([sys.executable, "-c", WRITER, *args], stdout=subprocess.PIPE, text=True)
    assert first.stdout.readline().strip() == "building"
    path = ensure_warm_start(tmp_path, MICRO_MODEL, ws, num_threads=1)
    assert count_training == []  # this writer waited for the lock, then found the entry built
    assert first.communicate(timeout=300)[0].strip() == str(path)
    assert first.returncode == 0
    assert entries(tmp_path) == [path.name]


def test_killed_writer_blocks_no_one_and_its_temp_dir_is_cleaned(tmp_path):
    """A writer killed mid-build (SIGKILL skips clean-up) leaves a temp dir but no held lock."""
    ws = micro_ws()
    name = warm_start_dir(tmp_path, MICRO_MODEL, ws).name
    holder = subprocess.Popen(
        [sys.executable, "-c", (
            "import sys, time, pathlib; from filelock import FileLock\n"
            f"FileLock({str(tmp_path / f'.{name}.lock')!r}).acquire()\n"
            f"tmp = pathlib.Path({str(tmp_path / f'.{name}.tmp-dead')!r}); tmp.mkdir()\n"
            "(tmp / 'model.safetensors').write_text('half written')\n"
            "print('building', flush=True); time.sleep(600)"
        )],
        stdout=subprocess.PIPE, text=True,
    )
    assert holder.stdout.readline().strip() == "building"
    holder.kill()
    holder.wait()
    path = ensure_warm_start(tmp_path, MICRO_MODEL, ws, num_threads=1)
    assert entries(tmp_path) == [path.name]


def test_loss_decreases_on_a_fixed_batch():
    # One thread: on a busy 2-core machine two spinning threads make this test 10x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _fixed_batch_losses_decrease()
    finally:
        torch.set_num_threads(threads)


def _fixed_batch_losses_decrease():
    torch.manual_seed(0)
    tok = build_char_tokenizer()
    ws = micro_ws(steps=30, batch_size=8, lr=3e-3, warmup_steps=3, num_examples=8)
    enc = encode_examples(tok, generate_arithmetic(8, level=1), ws.system_prompt, ws.max_length)
    model = build_tiny_model(seed=0, **MICRO_MODEL)
    curve = warmstart.train_model(model, enc, ws, log_every=5)
    losses = [e["loss"] for e in curve]
    assert len(losses) == 6
    assert losses[-1] < 0.7 * losses[0], losses


def test_shared_prefix_loss_matches_full_sequence_loss():
    """The system-prompt prefix trick computes exactly the loss (and gradients) of full sequences."""
    tok = build_char_tokenizer()
    enc = encode_examples(tok, generate_arithmetic(6, level=2), QWEN_MATH_SYSTEM_PROMPT, 256)
    assert len(enc.prefix) > 50  # the whole system turn is shared
    assert tok.decode(enc.prefix).startswith("<|im_start|>system\n" + QWEN_MATH_SYSTEM_PROMPT)
    model = build_tiny_model(seed=1, **MICRO_MODEL)
    ids, labels = collate(enc, list(range(6)))
    prefix = torch.tensor([enc.prefix])
    full_ids = torch.cat([prefix.expand(6, -1), ids], dim=1)
    full_labels = torch.cat([torch.full((6, prefix.shape[1]), -100), labels], dim=1)
    shared = sequence_loss(model, prefix, ids, labels)
    full = sequence_loss(model, None, full_ids, full_labels)
    assert torch.allclose(shared, full, atol=1e-5)
    # Labels cover exactly the response (solution + <|im_end|>).
    row = labels[0][labels[0] != -100].tolist()
    assert tok.decode(row) == generate_arithmetic(6, level=2)[0].solution + "<|im_end|>"
    g_shared = torch.autograd.grad(shared, list(model.parameters()))
    g_full = torch.autograd.grad(full, list(model.parameters()))
    for a, b in zip(g_shared, g_full, strict=True):
        assert torch.allclose(a, b, atol=1e-5)


def test_no_system_prompt_has_no_shared_prefix():
    tok = build_char_tokenizer()
    enc = encode_examples(tok, generate_arithmetic(4, level=1), None, 256)
    assert enc.prefix == []
    assert tok.decode(enc.suffixes[0]).startswith("<|im_start|>user\n")


def test_grading_is_the_rl_graders():
    """The accuracy counts what RL rewards: the last boxed answer, as MathGrader reads it."""
    grader = MathGrader(num_workers=0)
    assert grader.grade("5 * 2 = 10. 10 - 4 = 6. \\boxed{6}", "6").score == 1.0
    assert grader.grade("\\boxed{1} then \\boxed{ 12 }", "12").score == 1.0
    assert grader.grade("\\boxed{12} then \\boxed{1}", "12").score == 0.0
    assert grader.grade("\\boxed{10}", "12").score == 0.0
    assert grader.grade("10", "10").score == 0.0
