"""load_math_file: every shared data file, plus malformed-input behaviour on temp files; the hub
loader (load_math_hub) on local parquet and json files, through the same datasets call."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest

from medsrl.data.example import MathExample, prompt_key
from medsrl.data.loaders import DataError, load_math_file, load_math_hub, strip_instructions
from medsrl.reward.extract import extract_last_boxed
from shared_paths import require_shared

LOGGER = "medsrl.data.loaders"

# file -> (examples kept, rows skipped, first problem prefix, first answer), read off the files.
SHARED_FILES = {
    "math500/test.jsonl": (
        500,
        0,
        "Convert the point $(0,3)$ in rectangular coordinates to polar coordinates.",
        "\\left( 3, \\frac{\\pi}{2} \\right)",
    ),
    "aime24/test.jsonl": (30, 0, "Every morning Aya goes for a $9$-kilometer-long walk", "204"),
    "amc23/test.jsonl": (40, 0, "Cities $A$ and $B$ are $45$ miles apart.", "27"),
    "minerva_math/test.jsonl": (
        272,
        0,
        "Each of the two Magellan telescopes has a diameter of $6.5 \\mathrm{~m}$.",
        "1.6",
    ),
    "olympiadbench/test.jsonl": (675, 0, "Xenia and Sergey play the following game.", "2"),
    "gsm8k/test.jsonl": (1319, 0, "Janet’s ducks lay 16 eggs per day.", "18"),
    "deepscaler_eval/aime.json": (
        30,
        0,
        "Every morning Aya goes for a $9$-kilometer-long walk",
        "204",
    ),
    "deepscaler_eval/amc.json": (
        83,
        0,
        "$\\frac{m}{n}$ is the Irreducible fraction value of \\[3+\\frac{1}{3+",
        "142",
    ),
    "deepscaler_eval/math.json": (
        500,
        0,
        "Convert the point $(0,3)$ in rectangular coordinates",
        "\\left( 3, \\frac{\\pi}{2} \\right)",
    ),
    "deepscaler_eval/minerva.json": (272, 0, "If the Bohr energy levels scale as $Z^{2}$,", "9.6"),
    "deepscaler_eval/olympiad_bench.json": (
        675,
        0,
        "Xenia and Sergey play the following game.",
        "2",
    ),
    "math_train/math.json": (7470, 4, "Let \\[f(x) = \\left\\{\n\\begin{array}{cl} ax+3,", "0"),
    "math_train_verl/train.parquet": (
        7498,
        2,
        "Let \\[f(x) = \\left\\{\n\\begin{array}{cl} ax+3,",
        "0",
    ),
    "simplelr_math_35/train.parquet": (
        8521,
        2,
        "Let $a$ and $b$ be the two real values of $x$ for which\\[\\sqrt[3]{x}",
        "118",
    ),
    "dapo_math_17k/dapo_math_17k.parquet": (
        17917,
        0,
        "In triangle $ABC$, $\\sin \\angle A = \\frac{4}{5}$ and",
        "34",
    ),
    "deepscaler_train_aime/aime.json": (
        975,
        0,
        "Let $x$, $y$ and $z$ all exceed $1$ and let $w$ be a positive number",
        "60",
    ),
}

_cache: dict[str, list[MathExample]] = {}


def load_shared(rel: str) -> list[MathExample]:
    if rel not in _cache:
        _cache[rel] = load_math_file(require_shared("data", rel))
    return _cache[rel]


# ---------------------------------------------------------------------------------------------
# the shared files


@pytest.mark.shared
def test_every_shared_data_file_is_covered():
    data = require_shared("data")
    found = {
        str(p.relative_to(data))
        for p in data.glob("*/*")
        if p.suffix in (".jsonl", ".json", ".parquet")
    }
    assert found == set(SHARED_FILES)


@pytest.mark.shared
@pytest.mark.parametrize("rel", sorted(SHARED_FILES))
def test_shared_file(rel, caplog):
    count, skipped, problem_prefix, answer = SHARED_FILES[rel]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        examples = _cache[rel] = load_math_file(require_shared("data", rel))
    assert len(examples) == count
    first = examples[0]
    assert first.problem.startswith(problem_prefix)
    assert first.answer == answer
    assert first.row == 0
    assert first.key == prompt_key(first.problem)
    assert all(ex.problem and ex.answer for ex in examples)
    assert all(ex.problem == ex.problem.strip() for ex in examples)
    assert not any("\\boxed{}" in ex.problem for ex in examples)  # instruction suffixes stripped
    assert not any("<|im_start|>" in ex.problem for ex in examples)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == LOGGER]
    if skipped:
        assert len(warnings) == 1
        assert Path(rel).name in warnings[0].getMessage()
        assert f"skipped {skipped} of {count + skipped}" in warnings[0].getMessage()
    else:
        assert not warnings


@pytest.mark.shared
def test_math_train_skips_the_four_empty_answers(caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        examples = load_math_file(require_shared("data", "math_train", "math.json"))
    rows = {ex.row for ex in examples}
    assert {886, 1009, 5328, 5330}.isdisjoint(rows)
    assert {885, 887, 7473} <= rows
    (record,) = [r for r in caplog.records if r.name == LOGGER]
    assert "886, 1009, 5328, 5330" in record.getMessage()
    assert examples[0].source == "math"


@pytest.mark.shared
def test_aime24_keeps_leading_zeros():
    examples = load_shared("aime24/test.jsonl")
    by_row = {ex.row: ex.answer for ex in examples}
    assert (by_row[7], by_row[15], by_row[18]) == ("025", "073", "023")
    assert examples[0].source == "aime24"
    assert examples[0].solution.startswith("$\\frac{9}{s} + t = 4$")


@pytest.mark.shared
def test_amc23_integral_floats_lose_point_zero():
    answers = [ex.answer for ex in load_shared("amc23/test.jsonl")]
    assert not any(a.endswith(".0") for a in answers)
    assert all(a.lstrip("-").isdigit() for a in answers)  # e.g. 27.0 -> "27", -1.0 -> "-1"


@pytest.mark.shared
def test_gsm8k_number_after_hashes():
    examples = load_shared("gsm8k/test.jsonl")
    by_row = {ex.row: ex for ex in examples}
    assert by_row[146].answer == "2125"  # "#### 2,125": thousands separators removed
    assert by_row[201].answer == "114200"
    assert by_row[0].solution.startswith("Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.")
    assert "####" not in by_row[0].solution
    assert all("####" not in ex.answer and "," not in ex.answer for ex in examples)


@pytest.mark.shared
def test_minerva_answer_is_last_boxed_of_solution():
    examples = load_shared("minerva_math/test.jsonl")
    assert all(ex.answer == extract_last_boxed(ex.solution).strip() for ex in examples)
    # same problems carry an explicit answer list in deepscaler_eval; the first one agrees
    assert load_shared("deepscaler_eval/minerva.json")[0].answer == "9.6"  # ['9.6\n'] stripped


@pytest.mark.shared
def test_list_answers_are_joined():
    olympiad = load_shared("olympiadbench/test.jsonl")
    assert olympiad[0].answer == "2"  # final_answer ['2']
    minerva = load_shared("deepscaler_eval/minerva.json")
    assert any(", " in ex.answer for ex in minerva)  # multi-element lists


@pytest.mark.shared
def test_verl_suffix_stripped_and_keys_match_plain_math_train():
    verl = load_shared("math_train_verl/train.parquet")
    plain = load_shared("math_train/math.json")
    assert verl[0].problem.endswith("without lifting your pencil from the paper).")
    assert verl[0].key == plain[0].key
    assert verl[0].solution is None  # its "solution" column is only the final answer
    assert len({ex.key for ex in verl} & {ex.key for ex in plain}) == len(plain)


@pytest.mark.shared
def test_simplelr_uses_question_not_chat_prompt():
    first = load_shared("simplelr_math_35/train.parquet")[0]
    assert first.problem.endswith("Compute $p + q$.")
    assert "Please reason step by step" not in first.problem


@pytest.mark.shared
def test_explicit_fields_on_shared_parquet():
    path = require_shared("data", "dapo_math_17k", "dapo_math_17k.parquet")
    examples = load_math_file(
        path,
        name="dapo",
        problem_field="prompt.0.content",
        answer_field="reward_model.ground_truth",
        limit=3,
    )
    assert [ex.row for ex in examples] == [0, 1, 2]
    assert examples[0].answer == "34" and examples[0].source == "dapo"
    auto = load_shared("dapo_math_17k/dapo_math_17k.parquet")[0]
    assert examples[0] == dataclasses.replace(auto, source="dapo")


# ---------------------------------------------------------------------------------------------
# temp files


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


ROWS = [
    {"problem": "p0", "answer": "a0"},
    {"problem": "", "answer": "a1"},  # empty problem
    {"problem": "p2", "answer": "a2", "solution": "work \\boxed{a2}"},
    {"problem": "p3"},  # missing answer
    {"problem": "p4", "answer": "   "},  # blank answer
    {"problem": "p5", "answer": None},
    {"problem": "p6", "answer": 7},
    "not an object",
    {"problem": "p8", "answer": 2.5},
]


def test_bad_rows_skipped_counted_and_warned_once(tmp_path, caplog):
    path = write_jsonl(tmp_path / "mixed.jsonl", ROWS)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        examples = load_math_file(path)
    assert [(ex.row, ex.problem, ex.answer) for ex in examples] == [
        (0, "p0", "a0"),
        (2, "p2", "a2"),
        (6, "p6", "7"),
        (8, "p8", "2.5"),
    ]
    assert examples[1].solution == "work \\boxed{a2}"
    assert examples[0].solution is None
    assert examples[0].source == "mixed"
    records = [r for r in caplog.records if r.name == LOGGER]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    message = records[0].getMessage()
    assert str(path) in message
    assert "skipped 5 of 9" in message
    assert "rows 1, 3, 4, 5, 7" in message


def test_bad_row_raise_names_file_and_row(tmp_path):
    path = write_jsonl(tmp_path / "mixed.jsonl", ROWS)
    with pytest.raises(DataError) as err:
        load_math_file(path, on_bad_row="raise")
    assert str(path) in str(err.value)
    assert "row 1 " in str(err.value) and "line 2" in str(err.value)
    assert "empty problem" in str(err.value)


def test_bad_row_raise_in_json_list_names_row(tmp_path):
    path = tmp_path / "list.json"
    path.write_text(json.dumps([{"problem": "a", "answer": "1"}, {"problem": "b"}]))
    with pytest.raises(DataError, match=r"list\.json: row 1: missing answer"):
        load_math_file(path, on_bad_row="raise")


def test_invalid_on_bad_row_value(tmp_path):
    path = write_jsonl(tmp_path / "x.jsonl", ROWS[:1])
    with pytest.raises(ValueError, match="on_bad_row"):
        load_math_file(path, on_bad_row="ignore")


def test_bad_json_line_names_the_line(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"problem": "a", "answer": "1"}\n\n{"problem": "b", "answer": \n')
    with pytest.raises(DataError) as err:
        load_math_file(path)
    assert str(path) in str(err.value) and "line 3" in str(err.value)


def test_bad_json_file_names_the_line(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('[\n{"problem": "a", "answer": "1"},\n{"problem": "b" "answer": "2"}\n]')
    with pytest.raises(DataError, match=r"broken\.json: line 3"):
        load_math_file(path)


def test_json_must_be_a_list(tmp_path):
    path = tmp_path / "obj.json"
    path.write_text('{"problem": "a", "answer": "1"}')
    with pytest.raises(DataError, match="expected a JSON list"):
        load_math_file(path)


def test_jsonl_content_in_a_json_file(tmp_path):
    path = write_jsonl(tmp_path / "lines.json", [{"problem": "a", "answer": "1"}] * 2)
    assert [ex.row for ex in load_math_file(path)] == [0, 1]


def test_missing_file_and_unknown_extension(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_math_file(tmp_path / "absent.jsonl")
    csv = tmp_path / "data.csv"
    csv.write_text("problem,answer\n1+1,2\n")
    with pytest.raises(DataError, match=r"data\.csv: unknown file extension '\.csv'"):
        load_math_file(csv)


def test_corrupt_parquet(tmp_path):
    path = tmp_path / "bad.parquet"
    path.write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match=r"bad\.parquet"):
        load_math_file(path)


def test_explicit_dotted_fields_jsonl(tmp_path):
    rows = [
        {
            "prompt": [{"role": "user", "content": "What is 2+3?"}],
            "reward_model": {"ground_truth": "5"},
            "answer": "wrong",
        },
        {"prompt": [], "reward_model": {"ground_truth": "1"}},  # no prompt.0
    ]
    path = write_jsonl(tmp_path / "verl.jsonl", rows)
    examples = load_math_file(
        path, name="toy", problem_field="prompt.0.content", answer_field="reward_model.ground_truth"
    )
    assert [(ex.problem, ex.answer, ex.source) for ex in examples] == [("What is 2+3?", "5", "toy")]
    with pytest.raises(
        DataError, match=r"row 1 \(line 2\): missing problem \(field 'prompt\.0\.content'\)"
    ):
        load_math_file(path, problem_field="prompt.0.content", on_bad_row="raise")
    # auto-detection picks `answer` first
    assert load_math_file(path, limit=1)[0].answer == "wrong"


def test_boxed_answer_field_and_auto_boxed(tmp_path):
    rows = [{"problem": "p", "solution": "So $x=\\boxed{\\frac{1}{2}}$ and \\boxed{\\{3\\}}."}]
    path = write_jsonl(tmp_path / "s.jsonl", rows)
    assert load_math_file(path)[0].answer == "\\{3\\}"
    assert load_math_file(path, answer_field="boxed:solution")[0].answer == "\\{3\\}"


def test_answer_formats(tmp_path):
    rows = [
        {"question": "q0", "final_answer": ["1", " 2\n"]},
        {"question": "q1", "final_answer": [3.0, 4.5]},
        {"question": "q2", "gt_answer": 27.0},
        {"question": "q3", "answer": "Work.\n#### 1,450,000"},
        {"question": "q4", "reward_model": {"ground_truth": "-3"}},
    ]
    path = write_jsonl(tmp_path / "fmt.jsonl", rows)
    assert [ex.answer for ex in load_math_file(path)] == ["1, 2", "3, 4.5", "27", "1450000", "-3"]


def test_instruction_suffixes_and_chat_strings(tmp_path):
    rows = [
        {
            "problem": "Find x. Let's think step by step and output the final answer within \\boxed{}.",
            "answer": "1",
        },
        {
            "prompt": [
                {"role": "system", "content": "sys"},
                {"role": "user", "content": "Find y."},
            ],
            "answer": "2",
        },
        {
            "prompt": [
                {
                    "content": "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nFind z.\n"
                    "Please reason step by step, and put your final answer within "
                    "\\boxed{{}}.<|im_end|>\n<|im_start|>assistant\n"
                }
            ],
            "answer": "3",
        },
    ]
    path = write_jsonl(tmp_path / "suffix.jsonl", rows)
    problems = [ex.problem for ex in load_math_file(path)]
    assert problems == ["Find x.", "Find y.", "Find z."]
    assert strip_instructions("  A.  ") == "A."


def test_limit(tmp_path):
    path = write_jsonl(tmp_path / "x.jsonl", ROWS)
    assert [ex.row for ex in load_math_file(path, limit=2)] == [0, 2]
    assert load_math_file(path, limit=0) == []


def test_parquet_roundtrip(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table(
        {
            "prompt": [[{"role": "user", "content": "P0"}], [{"role": "user", "content": "P1"}]],
            "reward_model": [{"ground_truth": "10"}, {"ground_truth": ""}],
            "extra": [1, 2],
        }
    )
    path = tmp_path / "t.parquet"
    pq.write_table(table, path)
    examples = load_math_file(path)
    assert [(ex.problem, ex.answer, ex.row, ex.source) for ex in examples] == [("P0", "10", 0, "t")]
    with pytest.raises(DataError, match=r"t\.parquet: row 1: empty answer"):
        load_math_file(path, on_bad_row="raise")


def test_prompt_key_is_stable():
    assert len(prompt_key("x")) == 16
    assert prompt_key("x") == "11f6ad8ec52a2984"  # sha1("x")[:16]
    assert prompt_key("x") != prompt_key("y")


def test_require_shared_skips_locally_and_fails_on_ci(tmp_path, monkeypatch):
    import shared_paths

    monkeypatch.setattr(shared_paths, "SHARED_DIR", tmp_path)
    (tmp_path / "data").mkdir()
    assert shared_paths.require_shared("data") == tmp_path / "data"
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="MEDSRL_SHARED_DIR"):
        shared_paths.require_shared("data", "absent.jsonl")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="absent.jsonl"):
        shared_paths.require_shared("data", "absent.jsonl")


def test_data_files_are_found_where_make_data_or_medsrl_data_dir_put_them(tmp_path, monkeypatch):
    """A clone without the shared folder: the data tests read what `make data` fetched into the
    repo's data/, or $MEDSRL_DATA_DIR, first; the tokenizer still comes from the shared folder."""
    import shared_paths

    monkeypatch.setattr(shared_paths, "SHARED_DIR", tmp_path / "absent")
    monkeypatch.setattr(shared_paths, "REPO_ROOT", tmp_path / "clone")
    monkeypatch.delenv("MEDSRL_DATA_DIR", raising=False)
    monkeypatch.delenv("CI", raising=False)
    fetched = tmp_path / "clone" / "data" / "aime24" / "test.jsonl"
    fetched.parent.mkdir(parents=True)
    fetched.write_text("{}\n")
    assert shared_paths.require_shared("data", "aime24", "test.jsonl") == fetched
    assert shared_paths.data_dir() == tmp_path / "clone" / "data"
    own = tmp_path / "own" / "aime24" / "test.jsonl"
    own.parent.mkdir(parents=True)
    own.write_text("{}\n")
    monkeypatch.setenv("MEDSRL_DATA_DIR", str(tmp_path / "own"))
    assert shared_paths.require_shared("data", "aime24", "test.jsonl") == own  # the user's folder first
    with pytest.raises(pytest.skip.Exception, match="make data"):
        shared_paths.require_shared("tokenizers", "qwen2.5-math")


# ---------------------------------------------------------------------------------------------
# hub data sets: the same datasets.load_dataset call on local files ("parquet" / "json" builders)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """``datasets`` offline, its cache in ``tmp_path``."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    return datasets


HUB_ROWS = [  # ROWS as a table: one type per column
    {"problem": "p0", "answer": "a0", "solution": None},
    {"problem": "", "answer": "a1", "solution": None},  # empty problem
    {"problem": "p2", "answer": "a2", "solution": "work \\boxed{a2}"},
    {"problem": "p3", "answer": None, "solution": None},  # no answer
    {"problem": "p4", "answer": "   ", "solution": None},  # blank answer
    {"problem": None, "answer": "a5", "solution": None},  # no problem
    {"problem": "p6", "answer": "7", "solution": None},
]


def write_parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_hub_loader_reads_a_local_parquet_as_the_file_loader(hub, tmp_path, caplog):
    path = write_parquet(tmp_path / "mixed.parquet", HUB_ROWS)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        examples = load_math_hub("parquet", data_files=str(path))
    assert examples == load_math_file(path)
    assert [(ex.row, ex.problem, ex.answer, ex.source) for ex in examples] == [
        (0, "p0", "a0", "mixed"), (2, "p2", "a2", "mixed"), (6, "p6", "7", "mixed")]
    assert examples[1].solution == "work \\boxed{a2}" and examples[0].solution is None
    (warning, *_) = [r for r in caplog.records if r.name == LOGGER]
    assert "hub data set 'parquet'" in warning.getMessage() and str(path) in warning.getMessage()
    assert "skipped 4 of 7" in warning.getMessage() and "rows 1, 3, 4, 5" in warning.getMessage()
    floats = write_parquet(tmp_path / "amc.parquet", [{"question": "q0", "gt_answer": 27.0},
                                                      {"question": "q1", "gt_answer": 2.5}])
    assert [ex.answer for ex in load_math_hub("parquet", data_files=str(floats))] == ["27", "2.5"]


def test_hub_loader_reads_local_json_and_jsonl_with_nested_fields(hub, tmp_path):
    rows = [
        {"prompt": [{"role": "user", "content": "What is 2+3? Let's think step by step and output "
                     "the final answer within \\boxed{}."}], "reward_model": {"ground_truth": "5"}},
        {"prompt": [{"role": "user", "content": "What is 1+1?"}], "reward_model": {"ground_truth": ""}},
        {"prompt": [{"role": "user", "content": "What is 2+2?"}], "reward_model": {"ground_truth": "4"}},
    ]
    listed = tmp_path / "verl.json"
    listed.write_text(json.dumps(rows))
    lines = write_jsonl(tmp_path / "verl.jsonl", rows)
    fields = {"problem_field": "prompt.0.content", "answer_field": "reward_model.ground_truth"}
    for path in (listed, lines):
        examples = load_math_hub("json", data_files=[str(path)], name="verl", **fields)
        assert examples == load_math_file(path, name="verl", **fields)
        assert [(ex.row, ex.problem, ex.answer) for ex in examples] == [
            (0, "What is 2+3?", "5"), (2, "What is 2+2?", "4")]
    assert [ex.row for ex in load_math_hub("json", data_files=str(lines), limit=1)] == [0]  # auto fields


def test_hub_bad_rows_raise_naming_the_data_set_and_row(hub, tmp_path):
    path = write_parquet(tmp_path / "mixed.parquet", HUB_ROWS)
    with pytest.raises(DataError) as err:
        load_math_hub("parquet", data_files=str(path), on_bad_row="raise")
    assert str(err.value) == (f"hub data set 'parquet' (data_files '{path}', split 'train'): row 1: "
                              "empty problem (field 'problem')")
    empty = write_parquet(tmp_path / "none.parquet", [{"problem": "", "answer": None}])
    with pytest.raises(DataError, match=r"none\.parquet.*none of its 1 rows is usable"):
        load_math_hub("parquet", data_files=str(empty))
    with pytest.raises(ValueError, match="on_bad_row"):
        load_math_hub("parquet", data_files=str(path), on_bad_row="ignore")


def test_hub_load_failures_name_the_data_set(hub, tmp_path):
    with pytest.raises(DataError, match=r"hub data set 'parquet' \(data_files '.*absent\.parquet'.*cannot load"):
        load_math_hub("parquet", data_files=str(tmp_path / "absent.parquet"))
    with pytest.raises(DataError, match=r"hub data set 'nobody/no-such-set' \(split 'test'\): cannot load"):
        load_math_hub("nobody/no-such-set", split="test")
    with pytest.raises(DataError, match=r"'json' builder needs data_files"):  # not every file under the cwd
        load_math_hub("json")


def test_file_loader_takes_a_hub_data_set_in_place_of_a_path(hub, tmp_path):
    path = write_parquet(tmp_path / "train.parquet", HUB_ROWS[:1])
    with pytest.raises(DataError, match=r"hub data set 'nobody/no-such-set' \(split 'test'\)"):
        load_math_file(hub="nobody/no-such-set", split="test")  # offline: found in no cache
    for args in ({}, {"path": path, "hub": "parquet"}):
        with pytest.raises(ValueError, match="give a file path or a hub data set"):
            load_math_file(**args)
    examples = load_math_hub("parquet", data_files={"train": [str(path)]}, name="t")
    assert [(ex.problem, ex.source) for ex in examples] == [("p0", "t")]


@pytest.mark.shared
def test_hub_loader_on_a_shared_parquet_matches_the_file_loader(hub):
    path = require_shared("data", "dapo_math_17k", "dapo_math_17k.parquet")
    assert load_math_hub("parquet", data_files=str(path), limit=50) == load_math_file(path, limit=50)


def test_a_hub_source_passes_the_config_check_and_a_bad_one_is_named():
    from medsrl.run_config import EvalRunConfig

    source = {"_target_": "medsrl.data.loaders.load_math_file", "path": None,
              "hub": "HuggingFaceH4/MATH-500", "split": "test"}
    EvalRunConfig.parse({"benchmark": {"m": source}})
    hub = {"_target_": "medsrl.data.loaders.load_math_hub", "hub": 3, "subset": None, "revision": "main"}
    with pytest.raises(ValueError) as err:
        EvalRunConfig.parse({"benchmark": {"m": hub}})
    assert str(err.value).splitlines()[1:] == [
        "  benchmark.m.hub must be a string or null, got 3 (benchmark 'm', medsrl.data.loaders.load_math_hub)"]
