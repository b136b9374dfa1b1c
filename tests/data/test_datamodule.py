"""MathDataModule: quotas, stateless step -> prompts, stages, resume, extra prompts, val."""

from __future__ import annotations

import logging
from collections import Counter
from itertools import islice
from types import SimpleNamespace

import pytest

from medsrl.data.datamodule import MathDataModule, largest_remainder_quotas
from medsrl.data.example import MathExample, Prompt, prompt_key
from medsrl.data.settings import DataConfig
from medsrl.data.template import render_prompt
from medsrl.settings import parse

LOGGER = "medsrl.data.datamodule"


def make_examples(prefix: str, n: int) -> list[MathExample]:
    out = []
    for i in range(n):
        problem = f"{prefix} problem {i}: what is {i} + 1?"
        out.append(MathExample(prompt_key(problem), problem, str(i + 1), prefix, i))
    return out


A = make_examples("a", 40)
B = make_examples("b", 30)
C = make_examples("c", 9)


def datamodule(stages, **settings) -> MathDataModule:
    """The module of ``stages`` and the other ``data`` settings, parsed as a run parses them."""
    return MathDataModule(parse(DataConfig, {"stages": stages, **settings}, "data"))


def two_stage(**kwargs) -> MathDataModule:
    stages = [
        {"name": "A", "start_step": 0, "datasets": [{"name": "a", "weight": 1.0, "source": A}]},
        {
            "name": "B",
            "start_step": 5,
            "datasets": [
                {"name": "b", "weight": 0.7, "source": B},
                {"name": "c", "weight": 0.3, "source": C},
            ],
        },
    ]
    kwargs.setdefault("prompts_per_step", 4)
    return datamodule(stages, **kwargs)


def keys(prompts: list[Prompt]) -> list[str]:
    return [p.key for p in prompts]


# ---------------------------------------------------------------------------------------------
# quotas


@pytest.mark.parametrize(
    ("weights", "total", "expected"),
    [
        ([0.7, 0.3], 16, [11, 5]),  # 11.2 / 4.8: the larger remainder gets the spare slot
        ([1, 1, 1], 4, [2, 1, 1]),  # tie -> earlier dataset
        ([0.98, 0.01, 0.01], 4, [2, 1, 1]),  # every dataset gets >= 1 when possible
        ([0.98, 0.01, 0.01], 2, [2, 0, 0]),  # not possible: plain largest remainder
        ([3, 1], 8, [6, 2]),
        ([5], 7, [7]),
    ],
)
def test_largest_remainder_quotas(weights, total, expected):
    quotas = largest_remainder_quotas(weights, total)
    assert quotas == expected
    assert sum(quotas) == total


def test_stage_quotas_and_step_composition():
    dm = two_stage(prompts_per_step=10)
    for step in range(5, 12):
        assert Counter(p.source for p in dm.prompts_for_step(step)) == {"b": 7, "c": 3}


def test_starved_dataset_warns(caplog):
    stages = [
        {
            "name": "S",
            "start_step": 0,
            "datasets": [
                {"name": "a", "weight": 0.98, "source": A},
                {"name": "b", "weight": 0.01, "source": B},
                {"name": "c", "weight": 0.01, "source": C},
            ],
        }
    ]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        datamodule(stages, prompts_per_step=2)
    assert any("too small" in r.getMessage() and "'b'" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------------------------------------
# determinism and epochs


def test_same_step_same_prompts_across_instances():
    dm1, dm2 = two_stage(seed=3), two_stage(seed=3)
    for step in (0, 1, 4, 5, 6, 100, 1000):
        assert dm1.prompts_for_step(step) == dm2.prompts_for_step(step)
        assert dm1.prompts_for_step(step) == dm1.prompts_for_step(step)


def test_steps_and_seeds_differ():
    dm = two_stage(seed=0)
    assert keys(dm.prompts_for_step(0)) != keys(dm.prompts_for_step(1))
    assert keys(dm.prompts_for_step(5)) != keys(dm.prompts_for_step(6))
    other = two_stage(seed=1)
    assert [keys(dm.prompts_for_step(s)) for s in range(4)] != [
        keys(other.prompts_for_step(s)) for s in range(4)
    ]


def test_full_epoch_covers_each_item_exactly_once():
    dm = two_stage(prompts_per_step=4)  # stage A: 40 items, 4 per step -> 10 steps per epoch
    stage_a = datamodule(
        [{"name": "A", "start_step": 0, "datasets": [{"name": "a", "weight": 1, "source": A}]}],
        prompts_per_step=4,
    )
    epoch0 = [k for s in range(10) for k in keys(stage_a.prompts_for_step(s))]
    epoch1 = [k for s in range(10, 20) for k in keys(stage_a.prompts_for_step(s))]
    assert sorted(epoch0) == sorted(ex.key for ex in A)
    assert sorted(epoch1) == sorted(ex.key for ex in A)
    assert epoch0 != epoch1  # a fresh permutation each epoch
    assert epoch0 != [ex.key for ex in A]  # shuffled
    # the two-stage module's stage A is the same schedule
    assert [keys(dm.prompts_for_step(s)) for s in range(5)] == [
        keys(stage_a.prompts_for_step(s)) for s in range(5)
    ]


def test_epochs_per_dataset_with_quotas():
    dm = two_stage(prompts_per_step=10)  # stage B: b (30 items) 7/step, c (9 items) 3/step
    c_keys = [p.key for s in range(5, 11) for p in dm.prompts_for_step(s) if p.source == "c"]
    assert len(c_keys) == 18
    assert sorted(c_keys[:9]) == sorted(ex.key for ex in C)
    assert sorted(c_keys[9:]) == sorted(ex.key for ex in C)
    b_keys = [p.key for s in range(5, 10) for p in dm.prompts_for_step(s) if p.source == "b"]
    assert sorted(b_keys[:30]) == sorted(ex.key for ex in B)


def test_prompt_fields_and_template():
    dm = two_stage(template={"system_prompt": None, "extra_empty_assistant_turn": True})
    (p, *_) = dm.prompts_for_step(0)
    ex = next(e for e in A if e.key == p.key)
    assert p.text == render_prompt(ex.problem, system_prompt=None, extra_empty_assistant_turn=True)
    assert (p.problem, p.answer, p.source) == (ex.problem, ex.answer, "a")
    default = two_stage().prompts_for_step(0)[0]
    assert default.text == render_prompt(default.problem)


# ---------------------------------------------------------------------------------------------
# stages


def test_stage_at():
    dm = two_stage()
    assert [dm.stage_at(s).name for s in (0, 1, 4, 5, 6, 10_000)] == ["A", "A", "A", "B", "B", "B"]
    with pytest.raises(ValueError):
        dm.stage_at(-1)


def test_stage_switch_prompts_and_log(caplog):
    dm = two_stage()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        batches = list(islice(iter(dm.train_dataloader()), 9))
    assert [b["step"] for b in batches] == list(range(9))
    assert [b["stage"] for b in batches] == ["A"] * 5 + ["B"] * 4
    for b in batches:
        sources = {p.source for p in b["prompts"]}
        assert sources == ({"a"} if b["step"] < 5 else {"b", "c"})
        assert b["prompts"] == dm.prompts_for_step(b["step"])
    switches = [r.getMessage() for r in caplog.records if "stage switch" in r.getMessage()]
    assert switches == ["stage switch A -> B at step 5"]
    assert all(r.levelno == logging.INFO for r in caplog.records)


def test_stage_b_starts_its_own_sequence():
    dm = two_stage()
    only_b = datamodule(
        [
            {
                "name": "B",
                "start_step": 0,
                "datasets": [
                    {"name": "b", "weight": 0.7, "source": B},
                    {"name": "c", "weight": 0.3, "source": C},
                ],
            }
        ],
        prompts_per_step=4,
    )
    for k in range(3):
        assert dm.prompts_for_step(5 + k) == only_b.prompts_for_step(k)


# ---------------------------------------------------------------------------------------------
# resume


def test_resume_from_trainer_global_step_matches_uninterrupted(caplog):
    uninterrupted = list(islice(iter(two_stage().train_dataloader()), 9))
    resumed_dm = two_stage()
    resumed_dm.trainer = SimpleNamespace(global_step=5)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        resumed = list(islice(iter(resumed_dm.train_dataloader()), 4))
    assert resumed[0]["step"] == 5
    assert resumed == uninterrupted[5:9]
    assert not any("stage switch" in r.getMessage() for r in caplog.records)
    detached = two_stage()
    assert next(iter(detached.train_dataloader()))["step"] == 0


def test_state_dict_and_schedule_change_warning(caplog):
    dm = two_stage(seed=4)
    state = dm.state_dict()
    assert state == {"seed": 4, "stages": [("A", 0), ("B", 5)]}
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        two_stage(seed=4).load_state_dict(state)
    assert not caplog.records
    only_b = datamodule(
        [{"name": "B", "start_step": 0, "datasets": [{"name": "b", "weight": 1, "source": B}]}],
        seed=5,
    )
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        only_b.load_state_dict(state)
    messages = " | ".join(r.getMessage() for r in caplog.records)
    assert "stage schedule changed" in messages and "seed changed" in messages


# ---------------------------------------------------------------------------------------------
# extra prompts (DAPO dynamic sampling)


def test_extra_prompts_deterministic_distinct_and_weighted():
    dm = two_stage(prompts_per_step=10)
    step = 7
    regular = set(keys(dm.prompts_for_step(step)))
    first = dm.extra_prompts(step, round=0, n=10)
    assert first == two_stage(prompts_per_step=10).extra_prompts(step, round=0, n=10)
    assert len(first) == 10
    assert len(set(keys(first))) == 10
    assert regular.isdisjoint(keys(first))
    assert Counter(p.source for p in first) == {"b": 7, "c": 3}
    second = dm.extra_prompts(step, round=1, n=10)
    assert keys(second) != keys(first)
    assert regular.isdisjoint(keys(second))
    assert keys(dm.extra_prompts(step + 1, round=0, n=10)) != keys(first)
    assert {p.source for p in dm.extra_prompts(2, round=0, n=5)} == {"a"}  # stage A
    assert dm.extra_prompts(step, round=0, n=0) == []
    small = dm.extra_prompts(step, round=3, n=1)
    assert len(small) == 1 and small[0].key not in regular


def test_extra_prompts_when_dataset_is_small():
    dm = two_stage(prompts_per_step=10)  # c has 9 items, 3 used by the step
    extra = [p for p in dm.extra_prompts(5, round=0, n=30) if p.source == "c"]
    assert len(extra) == 9
    assert len(set(keys(extra[:6]))) == 6  # the 6 unused ones come first
    assert set(keys(extra[:6])).isdisjoint(keys(dm.prompts_for_step(5)))


# ---------------------------------------------------------------------------------------------
# validation of the config


def stage(name, start, datasets=None):
    return {
        "name": name,
        "start_step": start,
        "datasets": datasets if datasets is not None else [{"name": "a", "weight": 1, "source": A}],
    }


@pytest.mark.parametrize(
    ("stages", "kwargs", "match"),
    [
        ([], {}, "non-empty"),
        ([stage("A", 0), stage("A", 5)], {}, "unique"),
        ([stage("A", 0), stage("B", 0)], {}, "strictly increasing"),
        ([stage("A", 0), stage("B", 10), stage("C", 5)], {}, "strictly increasing"),
        ([stage("A", 3)], {}, "must start at step 0"),
        ([stage("A", 0, [])], {}, "non-empty list of datasets"),
        ([stage("A", 0, [{"name": "a", "weight": 0, "source": A}])], {}, "weight must be a positive number"),
        ([stage("A", 0, [{"name": "a", "weight": -1, "source": A}])], {}, "weight must be a positive number"),
        ([stage("A", 0, [{"name": "a", "weight": 1, "source": []}])], {}, "is empty"),
        ([stage("A", 0, [{"name": "a", "weight": 1}])], {}, "source must be set"),
        (
            [
                stage(
                    "A",
                    0,
                    [
                        {"name": "a", "weight": 1, "source": A},
                        {"name": "a", "weight": 1, "source": B},
                    ],
                )
            ],
            {},
            "dataset names must be unique",
        ),
        ([{"name": "A", "start_step": 0, "datasets": [], "oops": 1}], {}, "oops is not a setting of"),
        ([stage("A", 0)], {"prompts_per_step": 0}, "prompts_per_step"),
        ([stage("A", 0)], {"template": {"system": "x"}}, "template"),
        ([stage("A", 0)], {"val_size": 0}, "val_size"),
    ],
)
def test_invalid_config(stages, kwargs, match):
    with pytest.raises(ValueError, match=match):
        datamodule(stages, **kwargs)


def test_lazy_callable_source():
    calls = []

    def load():
        calls.append(1)
        return B

    dm = datamodule(
        [
            {"name": "A", "start_step": 0, "datasets": [{"name": "a", "source": A}]},
            {"name": "B", "start_step": 3, "datasets": [{"name": "b", "source": load}]},
        ],
        prompts_per_step=2,
    )
    assert calls == []  # not loaded before stage B is needed
    dm.prompts_for_step(0)
    assert calls == []
    assert {p.source for p in dm.prompts_for_step(3)} == {"b"}
    dm.prompts_for_step(4)
    assert calls == [1]

    empty = datamodule([{"name": "A", "start_step": 0, "datasets": [{"name": "a", "source": lambda: []}]}])
    with pytest.raises(ValueError, match="'a' is empty"):
        empty.prompts_for_step(0)


# ---------------------------------------------------------------------------------------------
# validation data


def test_val_none_gives_no_prompts():
    assert two_stage().val_prompts() == []


def test_val_union_shuffled_and_cut():
    val = [{"name": "vb", "source": B}, {"name": "vc", "source": C}]
    dm = two_stage(val=val, val_size=20)
    flat = dm.val_prompts()
    assert all(isinstance(p, Prompt) for p in flat)
    assert len(set(keys(flat))) == 20
    assert set(keys(flat)) <= {ex.key for ex in B + C}
    assert keys(flat) == keys(two_stage(val=val, val_size=20).val_prompts())  # seeded
    assert dm.val_prompts() is flat  # built once
    everything = two_stage(val=val, val_size=None)
    only = everything.val_prompts()
    assert sorted(keys(only)) == sorted(ex.key for ex in B + C)
    assert keys(only)[:20] == keys(flat)  # val_size keeps a prefix of the same shuffle
    assert {p.source for p in only} == {"vb", "vc"}
    assert keys(only) != [ex.key for ex in B + C]


# ---------------------------------------------------------------------------------------------
# Hydra


def test_file_sources_are_built_by_hydra(tmp_path):
    from omegaconf import OmegaConf

    path = tmp_path / "toy.jsonl"
    path.write_text(
        "".join(
            f'{{"problem": "What is {i}+{i}? Use \\\\boxed{{}}.", "answer": "{2 * i}"}}\n'
            for i in range(6)
        )
    )
    cfg = OmegaConf.create(
        {
            "prompts_per_step": 3,
            "template": {"system_prompt": None},
            "stages": [
                {
                    "name": "A",
                    "start_step": 0,
                    "datasets": [
                        {
                            "name": "toy",
                            "weight": 1,
                            "source": {
                                "_target_": "medsrl.data.loaders.load_math_file",
                                "path": str(path),
                            },
                        }
                    ],
                },
                {
                    "name": "B",
                    "start_step": 2,
                    "datasets": [
                        {
                            "name": "lazy",
                            "weight": 1,
                            "source": {
                                "_target_": "medsrl.data.loaders.load_math_file",
                                "_partial_": True,
                                "path": str(path),
                            },
                        }
                    ],
                },
            ],
            "val": [
                {
                    "name": "v",
                    "source": {"_target_": "medsrl.data.loaders.load_math_file", "path": str(path)},
                }
            ],
        }
    )
    dm = MathDataModule(parse(DataConfig, cfg, "data"))
    assert ("A", "toy") in dm._loaded and ("B", "lazy") not in dm._loaded  # _partial_: loaded at first use
    assert {p.answer for s in (0, 1) for p in dm.prompts_for_step(s)} == {
        "0",
        "2",
        "4",
        "6",
        "8",
        "10",
    }
    assert {p.source for p in dm.prompts_for_step(2)} == {"lazy"}
    assert dm.prompts_for_step(0)[0].text.startswith("<|im_start|>user\nWhat is")
    assert len(dm.val_prompts()) == 6


# ---------------------------------------------------------------------------------------------
# a real Lightning Trainer: batches reach the module, resume continues exactly


def test_lightning_fit_and_resume(tmp_path):
    import lightning
    import torch

    class Recorder(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))
            self.seen: list[tuple[int, str, list[str]]] = []

        def training_step(self, batch, batch_idx):
            self.seen.append((batch["step"], batch["stage"], keys(batch["prompts"])))
            return (self.w - 1.0).pow(2).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def trainer(max_steps):
        return lightning.Trainer(
            max_steps=max_steps,
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )

    val = [{"name": "vc", "source": C}]
    first = Recorder()
    t1 = trainer(4)
    t1.fit(first, datamodule=two_stage(val=val))
    ckpt = tmp_path / "step4.ckpt"
    t1.save_checkpoint(ckpt)
    assert [s for s, _, _ in first.seen] == [0, 1, 2, 3]

    second = Recorder()
    dm2 = two_stage(val=val)
    trainer(8).fit(second, datamodule=dm2, ckpt_path=str(ckpt))
    assert [(s, st) for s, st, _ in second.seen] == [(4, "A"), (5, "B"), (6, "B"), (7, "B")]
    reference = two_stage()
    for step, _, ks in first.seen + second.seen:
        assert ks == keys(reference.prompts_for_step(step))


@pytest.mark.parametrize("precision", ["bf16-true", "16-true", "32-true"])
def test_a_batch_survives_lightnings_input_cast_and_transfer(precision):
    """Every GPU config trains in bf16-true, whose plugin casts each batch with
    ``apply_to_collection``; a frozen prompt dataclass made that fail at the first step."""
    from lightning.fabric.utilities.apply_func import move_data_to_device
    from lightning.pytorch.plugins.precision import FSDPPrecision, HalfPrecision

    batch = next(iter(two_stage().train_dataloader()))
    plugins = [FSDPPrecision(precision)]
    if precision != "32-true":
        plugins.append(HalfPrecision(precision))
    for plugin in plugins:
        out = move_data_to_device(plugin.convert_input(batch), "cpu")
        assert out["step"] == batch["step"]
        assert [p.text for p in out["prompts"]] == [p.text for p in batch["prompts"]]
        assert all(isinstance(p, Prompt) for p in out["prompts"])
