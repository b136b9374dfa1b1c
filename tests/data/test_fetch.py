"""medsrl-data (medsrl.data.fetch): the manifest, fetching from a file:// mirror of ../shared/data
into temp roots (sums, no half-written file, --check), and a clone's data=math on what it fetched."""

from __future__ import annotations

import hashlib
import re
import shutil
from pathlib import Path

import pytest

from medsrl.data import fetch
from medsrl.data.datamodule import MathDataModule
from medsrl.data.sources import MANIFEST, data_dir_default, set_data_dir_default
from medsrl.run_config import RunConfig
from run_helpers import ROOT, compose_train
from shared_paths import require_shared

DATA_MATH_FILES = {"math_train/math.json", "dapo_math_17k/dapo_math_17k.parquet",
                   "simplelr_math_35/train.parquet", "aime24/test.jsonl"}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run(capsys, *args: str) -> tuple[int, str, str]:
    """``medsrl-data args``: exit code, stdout, stderr."""
    code = fetch.main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def files_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


@pytest.fixture
def mirror() -> Path:
    """../shared/data, the public files as fetched (skipped without it, a failure on CI)."""
    return require_shared("data")


@pytest.fixture
def own_mirror(mirror, tmp_path) -> Path:
    """A copy of the mirror's aime24 and amc23 folders, to break."""
    copy = tmp_path / "mirror"
    for name in ("aime24", "amc23"):
        shutil.copytree(mirror / name, copy / name)
    return copy


@pytest.fixture
def env(monkeypatch):
    """The data-dir variables, each restored after the test (set then removed: a variable the
    test sets later is removed again too)."""
    for var in ("MEDSRL_DATA_DIR", "MEDSRL_SHARED_DIR", "MEDSRL_ROOT"):
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    monkeypatch.setenv("MEDSRL_ROOT", str(ROOT))
    return monkeypatch


# ---------------------------------------------------------------------------------------------
# the manifest


def test_every_file_a_config_reads_is_in_the_manifest():
    used = {m for p in (ROOT / "configs").rglob("*.yaml")
            for m in re.findall(r"\$\{paths\.data_dir\}/(\S+)", p.read_text())}
    assert DATA_MATH_FILES <= used
    assert used <= {f.local for f in MANIFEST}


def test_manifest_entries_are_pinned():
    assert len({f.local for f in MANIFEST}) == len(MANIFEST)
    for f in MANIFEST:
        assert re.fullmatch(r"[0-9a-f]{40}", f.commit), f.local
        assert re.fullmatch(r"[0-9a-f]{64}", f.sha256), f.local
        assert f.size > 0 and f.license and re.fullmatch(r"[\w.-]+/[\w.-]+", f.repo), f.local


@pytest.mark.shared
def test_manifest_is_the_shared_data_folder(mirror):
    """Every data file of ../shared/data, with the size and sum its SOURCE.md records."""
    assert {f for f in files_under(mirror) if not f.endswith(".md")} == {f.local for f in MANIFEST}
    for f in MANIFEST:
        assert ((mirror / f.local).stat().st_size, sha256(mirror / f.local)) == (f.size, f.sha256)


def test_url_templates():
    amc = next(f for f in MANIFEST if f.local == "amc23/test.jsonl")
    assert fetch.url_for(amc) == ("https://raw.githubusercontent.com/QwenLM/Qwen2.5-Math/"
                                  "a45202bd16f1ec06f433442dc1152d0074773465/evaluation/data/amc23/test.jsonl")
    assert fetch.url_for(amc, "file:///m/") == "file:///m/amc23/test.jsonl"  # a mirror of the root
    assert fetch.url_for(amc, "https://x/{owner}/{repo_name}@{commit}:{local}") == (
        "https://x/QwenLM/Qwen2.5-Math@a45202bd16f1ec06f433442dc1152d0074773465:amc23/test.jsonl")


def test_unknown_names_are_refused(capsys, tmp_path):
    code, _, err = run(capsys, "--root", tmp_path, "--only", "aime24,nope")
    assert code == 2 and "unknown data file(s) ['nope']" in err
    assert not any(tmp_path.iterdir())


# ---------------------------------------------------------------------------------------------
# fetching from a file:// mirror


@pytest.mark.shared
def test_fetches_every_file_then_nothing(mirror, tmp_path, capsys):
    root = tmp_path / "data"
    code, out, _ = run(capsys, "--root", root, "--base", mirror.as_uri())
    assert code == 0, out
    assert f"{len(MANIFEST)} fetched" in out and str(root) in out
    assert files_under(root) == {f.local for f in MANIFEST}  # no temp file left
    assert all(sha256(root / f.local) == f.sha256 for f in MANIFEST)
    stamps = {p: p.stat().st_mtime_ns for p in root.rglob("*")}

    code, out, _ = run(capsys, "--root", root, "--base", mirror.as_uri())
    assert code == 0 and f"{len(MANIFEST)} already there" in out and "fetched" not in out
    assert {p: p.stat().st_mtime_ns for p in root.rglob("*")} == stamps
    code, out, _ = run(capsys, "--root", root, "--check")
    assert code == 0 and f"{len(MANIFEST)} ok" in out


@pytest.mark.shared
def test_a_corrupted_mirror_file_fails_naming_it_and_leaves_nothing(own_mirror, tmp_path, capsys):
    bad = own_mirror / "aime24" / "test.jsonl"
    data = bytearray(bad.read_bytes())
    data[100] ^= 0x01
    bad.write_bytes(bytes(data))
    root = tmp_path / "data"
    code, out, err = run(capsys, "--root", root, "--base", own_mirror.as_uri(), "--only", "aime24", "amc23")
    assert code == 1
    expected = next(f.sha256 for f in MANIFEST if f.local == "aime24/test.jsonl")
    assert "aime24/test.jsonl: sha256 mismatch" in err and expected in err and sha256(bad) in err
    assert "1 fetched, 1 FAILED" in out
    assert files_under(root) == {"amc23/test.jsonl"}  # nothing of aime24, no temp file
    assert not (root / "aime24").exists()


@pytest.mark.shared
def test_a_file_missing_from_the_mirror_fails_naming_it(own_mirror, tmp_path, capsys):
    (own_mirror / "amc23" / "test.jsonl").unlink()
    root = tmp_path / "data"
    code, _, err = run(capsys, "--root", root, "--base", own_mirror.as_uri(), "--only", "amc23")
    assert code == 1
    assert f"amc23/test.jsonl: cannot fetch {own_mirror.as_uri()}/amc23/test.jsonl" in err
    assert not root.exists() or files_under(root) == set()


@pytest.mark.shared
def test_check_reports_a_bad_local_file_and_a_fetch_replaces_it(mirror, tmp_path, capsys):
    root = tmp_path / "data"
    assert run(capsys, "--root", root, "--base", mirror.as_uri(), "--only", "amc23")[0] == 0
    local = root / "amc23" / "test.jsonl"
    local.write_bytes(local.read_bytes()[:-1])
    code, out, err = run(capsys, "--root", root, "--check", "--only", "amc23", "aime24")
    assert code == 1 and "2 FAILED" in out
    expected = next(f.sha256 for f in MANIFEST if f.local == "amc23/test.jsonl")
    assert f"amc23/test.jsonl: sha256 mismatch ({local}): expected {expected}, got {sha256(local)}" in err
    assert "aime24/test.jsonl: missing" in err

    code, out, _ = run(capsys, "--root", root, "--base", mirror.as_uri(), "--only", "amc23")
    assert code == 0 and "fetched" in out and "replaced a file with sha256" in out
    assert sha256(local) == expected


# ---------------------------------------------------------------------------------------------
# the data root: the folder the configs read


def test_default_root_is_the_configs_data_dir(env, tmp_path):
    def composed_data_dir() -> Path:
        return Path(compose_train(tmp_path / "out", ["data=math"], debug=None).paths.data_dir)

    shared = tmp_path / "shared"
    (shared / "data").mkdir(parents=True)
    env.setenv("MEDSRL_SHARED_DIR", str(shared))  # a machine with the shared folder
    set_data_dir_default(ROOT)  # what the entry points do: nothing here
    assert fetch.default_root() == composed_data_dir() == shared / "data"

    env.setenv("MEDSRL_SHARED_DIR", str(tmp_path / "absent"))  # a clone on its own
    assert data_dir_default(ROOT) == ROOT / "data"
    set_data_dir_default(ROOT)
    assert fetch.default_root() == composed_data_dir() == ROOT / "data"

    env.setenv("MEDSRL_DATA_DIR", str(tmp_path / "mine"))  # the user's choice wins
    assert data_dir_default(ROOT) is None
    assert fetch.default_root() == composed_data_dir() == tmp_path / "mine"


@pytest.mark.shared
def test_a_clone_without_shared_reads_data_math_from_what_make_data_fetched(mirror, env, tmp_path, capsys):
    """No ../shared (MEDSRL_SHARED_DIR=/nonexistent), nothing set by the user: `make data`
    (medsrl-data, its default root) then data=math's datamodule loads every file from there."""
    clone = tmp_path / "clone"  # paths.root_dir of the clone
    env.setenv("MEDSRL_ROOT", str(clone))
    env.setenv("MEDSRL_SHARED_DIR", "/nonexistent")
    assert run(capsys, "--base", mirror.as_uri())[0] == 0
    assert files_under(clone / "data") == {f.local for f in MANIFEST}

    set_data_dir_default(clone)  # the entry point, before Hydra composes
    cfg = compose_train(tmp_path / "out", ["data=math"], debug=None)
    assert Path(cfg.paths.data_dir) == clone / "data"
    dm = MathDataModule(RunConfig.parse(cfg).data)
    loaded = {ds.name: len(dm.loaded((stage.name, ds.name))) for stage in dm.stages for ds in stage.datasets}
    assert loaded == {"math_train": 7470, "dapo_math_17k": 17917, "math_l3_5": 8521}
    assert len(dm.prompts_for_step(0)) == len(dm.prompts_for_step(100)) == 512
    assert {p.source for p in dm.prompts_for_step(100)} == {"dapo_math_17k", "math_l3_5"}
    assert len(dm.val_prompts()) == 30


@pytest.mark.slow
def test_the_entry_points_point_a_clone_without_shared_at_its_own_data_folder(tmp_path):
    """``medsrl-train`` / ``medsrl-eval`` (and ``medsrl-plan``, through train) read ``data/`` of
    the repository on a clone with no ``../shared`` and no ``MEDSRL_DATA_DIR``: where ``make data``
    writes."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "MEDSRL_DATA_DIR"}
    env.update(MEDSRL_ROOT=str(tmp_path), MEDSRL_SHARED_DIR="/nonexistent")
    for module in ("medsrl.train", "medsrl.eval"):
        out = subprocess.run([sys.executable, "-c", f"import {module}, os; print(os.environ['MEDSRL_DATA_DIR'])"],
                             env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip() == str(tmp_path / "data"), module
