"""MathDataModule.limit_prompt_tokens: prompts longer than the rollout engine takes are dropped at
load, from every stage and the val set, counted and logged per dataset; the schedule stays a pure
function of (seed, step); a dataset that loses too much fails at the start (issue 35)."""

from __future__ import annotations

import logging
from itertools import islice
from pathlib import Path
from types import SimpleNamespace

import pytest

from medsrl.data.datamodule import MathDataModule, prompt_token_counts
from medsrl.data.example import MathExample, prompt_key
from medsrl.data.settings import DataConfig
from medsrl.models.char_tokenizer import build_char_tokenizer
from medsrl.models.loading import load_tokenizer
from medsrl.rollout.factory import describe_prompt_token_limit, prompt_token_limit
from medsrl.rollout.settings import RolloutConfig
from medsrl.run_config import RunConfig
from medsrl.settings import parse
from run_helpers import compose_train
from shared_paths import data_dir, require_shared

LOGGER = "medsrl.data.datamodule"
PLAIN = {"kind": "plain", "system_prompt": None}  # the prompt is the problem and "\n": 1 char, 1 token
TOK = build_char_tokenizer()


def examples(prefix: str, lengths: list[int]) -> list[MathExample]:
    """Problems of exactly these lengths in characters (``prefix`` + index, padded with x)."""
    out = []
    for i, n in enumerate(lengths):
        problem = f"{prefix}{i} ".ljust(n, "x")
        assert len(problem) == n
        out.append(MathExample(prompt_key(problem), problem, "1", prefix, i))
    return out


SHORT = examples("a", [10 + i % 20 for i in range(60)])  # 10..29 characters
MIXED = examples("b", [10 + i % 20 for i in range(58)] + [50, 80])  # 2 of 60 too long at 40
VAL = examples("v", [12, 15, 60, 20])


def module(**kwargs) -> MathDataModule:
    stages = [
        {"name": "A", "start_step": 0, "datasets": [{"name": "short", "source": SHORT}]},
        {"name": "B", "start_step": 3, "datasets": [{"name": "short", "weight": 1, "source": SHORT},
                                                     {"name": "mixed", "weight": 1, "source": MIXED}]},
    ]
    kwargs.setdefault("max_dropped_prompt_share", 0.05)
    return MathDataModule(parse(DataConfig, {"stages": stages, "val": [{"name": "val", "source": VAL}],
                                             "prompts_per_step": 8, "val_size": None, "template": PLAIN, "seed": 1,
                                             **kwargs}, "data"))


def lengths(prompts) -> list[int]:
    return prompt_token_counts(TOK, [p.text for p in prompts])


def test_prompt_token_counts_are_the_engines_in_batches():
    texts = [p.text for p in module().prompts_for_step(4)]
    whole = [len(ids) for ids in TOK(texts)["input_ids"]]  # rollout/base.py tokenize_prompts
    assert prompt_token_counts(TOK, texts, batch_size=3) == whole
    assert whole == [len(t) for t in texts]  # the char tokenizer: one token a character


def test_overlong_prompts_are_dropped_from_train_and_val_and_logged(caplog):
    dm = module(max_dropped_prompt_share=0.3)  # val loses 1 of its 4
    with caplog.at_level(logging.INFO, logger=LOGGER):
        drops = dm.limit_prompt_tokens(TOK, 40, why="test budget")
    assert [(d.where, d.dropped, d.total, d.longest_kept) for d in drops] == [
        ("stage 'A' dataset 'short'", 0, 60, 30),  # 29 characters + "\n"
        ("stage 'B' dataset 'short'", 0, 60, 30),
        ("stage 'B' dataset 'mixed'", 2, 60, 30),
        ("val dataset 'val'", 1, 4, 21),
    ]
    for step in range(12):  # one epoch of 'mixed' and more: none of its long ones comes back
        assert max(lengths(dm.prompts_for_step(step))) <= 40
        assert max(lengths(dm.extra_prompts(step, 1, 16))) <= 40
    assert sorted(lengths(dm.val_prompts())) == [13, 16, 21]
    logged = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert logged == [
        (logging.INFO, "stage 'A' dataset 'short': all 60 prompts within 40 tokens (the longest has 30)"),
        (logging.INFO, "stage 'B' dataset 'short': all 60 prompts within 40 tokens (the longest has 30)"),
        (logging.WARNING, "stage 'B' dataset 'mixed': 2 of 60 prompts (3.33%) longer than 40 tokens, "
                          "dropped; the longest kept has 30 tokens"),
        (logging.WARNING, "val dataset 'val': 1 of 4 prompts (25.00%) longer than 40 tokens, dropped; "
                          "the longest kept has 21 tokens"),
    ]


def test_a_dataset_over_the_share_fails_at_the_start_naming_it():
    dm = module()  # val loses 1 of 4: 25% > 5%
    with pytest.raises(ValueError) as err:
        dm.limit_prompt_tokens(TOK, 40, why="min(rollout.max_prompt_tokens 8 + rollout.max_new_tokens 40, ...)")
    message = str(err.value)
    assert "val dataset 'val': 1 of 4 prompts (25.00%) longer than 40 tokens" in message
    assert "'mixed'" not in message  # 3.33% is within the share
    assert "data.max_dropped_prompt_share=0.05" in message
    assert "min(rollout.max_prompt_tokens 8 + rollout.max_new_tokens 40" in message  # the why
    assert "rollout.max_prompt_tokens / rollout.max_new_tokens / rollout.vllm.max_model_len" in message


def test_losing_a_whole_dataset_fails_whatever_the_share():
    dm = module(max_dropped_prompt_share=1.0)
    with pytest.raises(ValueError, match=r"stage 'A' dataset 'short': 60 of 60 prompts \(100.00%\) longer than 5"):
        dm.limit_prompt_tokens(TOK, 5)
    with pytest.raises(ValueError, match="max_dropped_prompt_share must be a number in"):
        module(max_dropped_prompt_share=1.5)


def test_the_schedule_stays_a_pure_function_of_seed_and_step():
    def limited() -> MathDataModule:
        dm = module(max_dropped_prompt_share=0.3)
        dm.limit_prompt_tokens(TOK, 40)
        return dm

    dm, again = limited(), limited()
    for step in (0, 2, 3, 7, 11):
        first = dm.prompts_for_step(step)
        assert first == dm.prompts_for_step(step) == again.prompts_for_step(step)
        assert dm.extra_prompts(step, 2, 5) == again.extra_prompts(step, 2, 5)
    uninterrupted = list(islice(iter(dm.train_dataloader()), 10))
    resumed = limited()
    resumed.trainer = SimpleNamespace(global_step=6)
    assert list(islice(iter(resumed.train_dataloader()), 4)) == uninterrupted[6:10]
    # the limit lifted: every prompt back, the schedule of an unlimited module
    dm.limit_prompt_tokens(TOK, None)
    assert dm.prompts_for_step(7) == module().prompts_for_step(7)


def test_the_limit_is_saved_and_a_changed_one_warned_on_resume(caplog):
    dm = module(max_dropped_prompt_share=0.3)
    dm.limit_prompt_tokens(TOK, 40)
    state = dm.state_dict()
    assert state["prompt_token_limit"] == 40
    other = module(max_dropped_prompt_share=0.3)
    other.limit_prompt_tokens(TOK, 60)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        other.load_state_dict(state)
    assert any("prompt token limit changed since the checkpoint: 40 -> 60" in r.getMessage()
               for r in caplog.records)


def test_the_limit_counts_the_rendered_prompt():
    system = {"kind": "plain", "system_prompt": "S" * 20}  # "S...S\n\n" + problem + "\n"
    stage = {"name": "A", "start_step": 0, "datasets": [{"name": "short", "source": SHORT}]}
    dm = MathDataModule(DataConfig(stages=[stage], template=system, max_dropped_prompt_share=1.0))
    drops = dm.limit_prompt_tokens(TOK, 40)
    assert (drops[0].dropped, drops[0].longest_kept) == (len([e for e in SHORT if len(e.problem) > 17]), 40)


# ---------------------------------------------------------------- the real data (issue 35)

def composed(experiment: str):
    return compose_train(Path("/tmp/unused"), [f"experiment={experiment}",
                                               f"paths.data_dir={data_dir()}"], debug=None)


def limit_of(cfg) -> int:
    """The run's prompt limit for a policy with the model config's positions."""
    policy = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=cfg.model.shape.max_position_embeddings))
    rollout = parse(RolloutConfig, cfg.rollout, "rollout")
    assert "the model's 4096 positions" in describe_prompt_token_limit(rollout, policy)
    return prompt_token_limit(rollout, policy)


@pytest.mark.parametrize("experiment", ["qwen2.5-math-1.5b_dapo", "qwen2.5-math-1.5b_meds",
                                        "qwen2.5-math-7b_dapo", "qwen2.5-math-7b_meds"])
def test_qwen_math_experiments_take_the_papers_1024_prompt_tokens(experiment):
    cfg = composed(experiment)
    assert cfg.rollout.max_prompt_tokens == 1024 and cfg.rollout.max_new_tokens == 3072
    assert limit_of(cfg) == 1024  # = 4096 positions - 3072: max_prompt_tokens fills them exactly


@pytest.mark.shared
def test_step_100_of_data_math_fits_the_engine_after_the_filter(caplog):
    """The stage-B step that stopped every Qwen2.5-Math vLLM run: its 1,063-token prompt is gone."""
    tokenizer = load_tokenizer(str(require_shared("tokenizers", "qwen2.5-math")))
    for part in ("math_train/math.json", "dapo_math_17k/dapo_math_17k.parquet",
                 "simplelr_math_35/train.parquet", "aime24/test.jsonl"):
        require_shared("data", *part.split("/"))
    cfg = composed("qwen2.5-math-1.5b_dapo")
    limit = limit_of(cfg)
    dm = MathDataModule(RunConfig.parse(cfg).data)
    dm.use_tokenizer(tokenizer)
    assert dm.stage_at(100).name == "B" and dm.stage_at(99).name == "A"
    before = prompt_token_counts(tokenizer, [p.text for p in dm.prompts_for_step(100)])
    assert max(before) > limit  # what vLLM's _check_lengths refused
    with caplog.at_level(logging.INFO, logger=LOGGER):
        drops = dm.limit_prompt_tokens(tokenizer, limit)
    after = prompt_token_counts(tokenizer, [p.text for p in dm.prompts_for_step(100)])
    assert len(after) == 512 and max(after) <= limit
    # the share each source loses: under 0.1 %, far within data.max_dropped_prompt_share
    assert {d.dataset: (d.dropped, d.total) for d in drops} == {
        "math_train": (7, 7470), "dapo_math_17k": (8, 17917), "math_l3_5": (8, 8521), "aime24": (0, 30)}
    assert all(d.longest_kept <= limit for d in drops)
    logged = " | ".join(r.getMessage() for r in caplog.records)
    assert "stage 'B' dataset 'dapo_math_17k'" in logged and "longer than 1024 tokens" in logged
