"""An empty or all-bad data file fails at start and names the file; a generated source that gives
nothing names its dataset and its generator."""

from __future__ import annotations

import functools
import json

import pytest

from medsrl.data.arithmetic import generate_arithmetic
from medsrl.data.datamodule import MathDataModule
from medsrl.data.loaders import DataError, default_name, load_math_file
from medsrl.data.settings import DataConfig
from run_helpers import compose_train

ONE = [{"problem": "1 + 1", "answer": "2"}]
BAD = [{"problem": "1 + 1"}, {"problem": "", "answer": "3"}]  # no answer; empty problem


def write(path, rows=(), text=None):
    path.write_text(text if text is not None else "".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    ("name", "text"),
    [("empty.jsonl", ""), ("blank.jsonl", "\n  \n"), ("empty.json", "[]"), ("nothing.json", '{"data": []}')],
)
def test_an_empty_file_names_itself(tmp_path, name, text):
    path = write(tmp_path / name, text=text)
    with pytest.raises(DataError, match="holds no rows") as err:
        load_math_file(path)
    assert str(path) in str(err.value)


def test_an_all_bad_file_names_itself_and_the_first_bad_row(tmp_path):
    path = write(tmp_path / "bad.jsonl", BAD)
    with pytest.raises(DataError) as err:
        load_math_file(path)
    assert str(err.value) == (f"{path}: none of its 2 rows is usable (missing or empty problem/answer; "
                              "first: row 0: missing answer (field 'answer'))")


def test_limit_zero_still_gives_nothing_and_one_good_row_is_enough(tmp_path):
    assert load_math_file(write(tmp_path / "bad.jsonl", BAD), limit=0) == []
    assert len(load_math_file(write(tmp_path / "mixed.jsonl", BAD + ONE))) == 1


def test_default_name_is_the_files_or_its_folders():
    assert default_name("/x/aime25.jsonl") == "aime25"
    assert default_name("/x/aime25/test.jsonl") == "aime25"


def test_an_empty_generated_source_names_its_dataset_and_generator():
    lazy = functools.partial(generate_arithmetic, num=0, split="train")
    stage = {"name": "A", "start_step": 0, "datasets": [{"name": "easy", "source": lazy}]}
    dm = MathDataModule(DataConfig(stages=[stage]))
    with pytest.raises(ValueError) as err:
        dm.prompts_for_step(0)
    msg = str(err.value)
    assert "dataset 'easy' is empty" in msg
    assert "medsrl.data.arithmetic.generate_arithmetic(num=0, split='train') gave no examples" in msg


def test_an_empty_val_source_fails_when_the_datamodule_is_built():
    stage = {"name": "A", "start_step": 0, "datasets": [{"name": "a", "source": generate_arithmetic(4)}]}
    with pytest.raises(ValueError, match="dataset 'held_out' is empty"):
        MathDataModule(DataConfig(stages=[stage], val=[{"name": "held_out", "source": []}]))


def _file_source(path, partial=False):
    extra = ", _partial_: true" if partial else ""
    return f"{{_target_: medsrl.data.loaders.load_math_file, path: '{path}'{extra}}}"


@pytest.fixture
def no_model(monkeypatch):
    import medsrl.train

    def fail(*args, **kwargs):
        raise AssertionError("the model was built before the data was checked")

    monkeypatch.setattr(medsrl.train, "build_policy", fail)


@pytest.mark.parametrize("rows", [[], BAD], ids=["empty", "all_bad"])
@pytest.mark.parametrize("where", ["train", "val"])
def test_training_on_an_empty_file_fails_before_the_model_and_names_the_file(tmp_path, no_model, rows, where):
    from medsrl.train import build_run

    path = write(tmp_path / "bad.jsonl", rows)
    good = "{_target_: medsrl.data.arithmetic.generate_arithmetic, num: 8, split: train}"
    train_src, val_src = (_file_source(path), good) if where == "train" else (good, _file_source(path))
    cfg = compose_train(tmp_path / "run", [
        f"data.stages=[{{name: A, start_step: 0, datasets: [{{name: bad, weight: 1.0, source: {train_src}}}]}}]",
        f"data.val=[{{name: v, source: {val_src}}}]",
    ])
    with pytest.raises(Exception) as err:  # Hydra wraps the loader's DataError
        build_run(cfg)
    assert not isinstance(err.value, AssertionError)
    assert str(path) in str(err.value)


def test_a_lazily_loaded_empty_file_names_itself_when_its_stage_comes(tmp_path):
    path = write(tmp_path / "later.jsonl")
    dm = MathDataModule(DataConfig.model_validate({
        "prompts_per_step": 1,
        "stages": [
            {"name": "A", "start_step": 0, "datasets": [{"name": "a", "source": list(ONE * 2)}]},
            {"name": "B", "start_step": 1, "datasets": [{"name": "b", "source": {
                "_target_": "medsrl.data.loaders.load_math_file", "_partial_": True, "path": str(path)}}]},
        ],
    }))
    dm.prompts_for_step(0)
    with pytest.raises(DataError, match="holds no rows") as err:
        dm.prompts_for_step(1)
    assert str(path) in str(err.value)
