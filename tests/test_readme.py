"""The README and docs/ say only what the repository has: every path they name exists, every
`make` target and console script they show is real, every command of the README's code blocks
composes with Hydra, `make help` lists every documented target, and the README stays short."""

from __future__ import annotations

import glob
import os
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser

from run_helpers import ROOT

README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
MAX_README_LINES = 260

# A path under these folders, optionally `::test_name`; `<placeholder>` parts stand for any name.
PATH = re.compile(r"(?<![\w./<>-])((?:src|configs|docs|benchmarks|studies|tests)/[\w./*<>-]*)(?:::(\w+))?")
ENTRY_POINTS = ("medsrl-train", "medsrl-eval", "medsrl-plan")


def code_of(text: str) -> list[str]:
    """The lines of fenced code blocks and the inline code spans of a markdown page, comments
    (`# ...`) removed."""
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M)
    spans = re.findall(r"`([^`\n]+)`", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M))
    lines = [line for block in blocks for line in block.splitlines()] + spans
    return [re.sub(r"(^|\s)#.*$", "", line).strip() for line in lines]


def named_paths(page: Path) -> list[tuple[int, str, str | None]]:
    found = []
    for number, line in enumerate(page.read_text().splitlines(), 1):
        for m in PATH.finditer(line):
            found.append((number, m.group(1).rstrip(".,:;"), m.group(2)))
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_path_a_page_names_exists(page):
    missing = []
    for number, path, test_name in named_paths(page):
        matches = glob.glob(str(ROOT / re.sub(r"<[^>]*>", "*", path)))
        if not matches:
            missing.append(f"{page.name}:{number}: {path}")
        elif test_name and not any(f"def {test_name}(" in Path(m).read_text() for m in matches if Path(m).is_file()):
            missing.append(f"{page.name}:{number}: {path}::{test_name} (no such test)")
    assert not missing, "named but not in the repository:\n" + "\n".join(missing)


def makefile_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", (ROOT / "Makefile").read_text(), re.M))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_make_target_a_page_shows_is_in_the_makefile(page):
    targets = makefile_targets()
    shown = {m for line in code_of(page.read_text()) for m in re.findall(r"(?<![\w./-])make ([a-z][\w-]*)", line)}
    assert shown <= targets, f"{page.name} shows make targets the Makefile lacks: {sorted(shown - targets)}"


def test_make_help_lists_every_documented_target():
    """`make help` greps the Makefile for `target: ... ## text`; a name its pattern misses (a
    digit, as in study-v2) was silently left out."""
    if shutil.which("make") is None:
        if os.environ.get("CI"):
            raise AssertionError("make is not installed")
        pytest.skip("make is not installed")
    documented = re.findall(r"^([A-Za-z0-9_.-]+)\s*:[^=\n]*?## ", (ROOT / "Makefile").read_text(), re.M)
    assert {"train", "test", "help", "study-v2"} <= set(documented)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}
    out = subprocess.run(["make", "--no-print-directory", "help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    listed = {line.split()[0] for line in re.sub(r"\x1b\[[0-9;]*m", "", out.stdout).splitlines() if line.strip()}
    assert set(documented) <= listed, f"make help leaves out {sorted(set(documented) - listed)}"


def test_the_readme_is_short():
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines (at most {MAX_README_LINES}): move detail to docs/"


def test_every_docs_page_is_in_the_readmes_index():
    text = README.read_text()
    absent = [p.name for p in DOCS if f"`docs/{p.name}`" not in text]
    assert not absent, f"README's documentation index lacks {absent}"


def test_every_console_script_the_readme_shows_is_installed_by_pyproject():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    shown = set(re.findall(r"\b(medsrl-[a-z]+)\b", README.read_text()))
    assert {"medsrl-train", "medsrl-eval", "medsrl-plan", "medsrl-data"} <= shown
    assert shown <= set(scripts), f"README names console scripts pyproject lacks: {sorted(shown - set(scripts))}"


def readme_commands() -> list[tuple[str, list[str]]]:
    """(config, Hydra overrides) of every medsrl-train / -eval / -plan command and every
    `make train ARGS="..."` in the README's code blocks and spans."""
    commands = []
    for line in code_of(README.read_text()):
        if not re.match(r"(make |\S*medsrl-)", line):  # a command line, not a layout sketch
            continue
        words = shlex.split(line)
        if words[:2] == ["make", "train"]:
            args = [w.split("=", 1)[1] for w in words if w.startswith("ARGS=")]
            commands.append(("train", shlex.split(args[0]) if args else []))
            continue
        for i, word in enumerate(words):
            if os.path.basename(word) in ENTRY_POINTS:
                config = "eval" if word.endswith("medsrl-eval") else "train"
                overrides = [w for w in words[i + 1:] if "=" in w and not w.startswith("-")]  # not --cfg job
                commands.append((config, overrides))
                break
    unique = {(config, tuple(overrides)): None for config, overrides in commands}
    return [(config, list(overrides)) for config, overrides in unique]


def test_the_readme_shows_the_quick_start_commands():
    commands = readme_commands()
    assert any(c == "eval" and "rollout=vllm" in o for c, o in commands)
    assert any("experiment=qwen2.5-math-7b_meds" in o for _, o in commands)
    assert len(commands) >= 10


@pytest.mark.parametrize(("config", "overrides"), readme_commands(),
                         ids=lambda v: v if isinstance(v, str) else " ".join(v) or "(defaults)")
def test_every_readme_command_composes(config, overrides):
    """Each command's overrides compose with the shipped configs (a sweep's swept values left
    out): a renamed group, option or key fails here, not on a user's machine."""
    overrides = [re.sub(r"<([^>]*)>", r"\1", o).replace(" ", "_") for o in overrides]  # <run>: a name
    parsed = OverridesParser.create().parse_overrides(overrides)
    plain = [o.input_line for o in parsed if not o.is_sweep_override()]
    if any(o.startswith("hparams_search=") or o.startswith("hydra/launcher=") for o in plain):
        pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
        pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(config, overrides=plain, return_hydra_config=True)
    assert cfg.task_name == config


def test_citation_and_license_match_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    cff = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    assert cff["cff-version"] == "1.2.0" and cff["version"] == project["version"]
    assert cff["license"] == project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert cff["authors"] == [{"name": "medsrl contributors"}]
    urls = {ref["url"] for ref in cff["references"]}
    assert urls == {"https://arxiv.org/abs/2604.11297", "https://arxiv.org/abs/2601.19620"}
    license_text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert "END OF TERMS AND CONDITIONS" in license_text
