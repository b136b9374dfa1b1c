"""Whether this Python can install medsrl: standard library only (it runs before anything is
installed, under the interpreter `make install` was given). Reads ``requires-python`` from
pyproject.toml; on an older Python says in one line on stderr what is needed and exits 2.

    python3 scripts/python_version.py [--version X.Y.Z]      # --version: check that one instead
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def required() -> tuple[int, int]:
    """The lower bound of ``requires-python = ">=X.Y"``."""
    match = re.search(r'^requires-python\s*=\s*">=\s*(\d+)\.(\d+)', PYPROJECT.read_text(), re.M)
    if not match:
        raise SystemExit(f"{PYPROJECT}: no requires-python = \">=X.Y\" line")
    return int(match.group(1)), int(match.group(2))


def problem(version: tuple[int, ...], need: tuple[int, int]) -> str | None:
    """The one-line message for ``version``, or None when it is supported."""
    if tuple(version[:2]) >= need:
        return None
    found = ".".join(map(str, version))
    want = ".".join(map(str, need))
    return (f"medsrl needs Python >= {want} (the lock's numpy and pandas and vLLM 0.32 have no wheels for "
            f"Python {found}); run `make install PYTHON=python{want}` or newer")


def main() -> None:
    args = sys.argv[1:]
    version = tuple(int(x) for x in args[1].split(".")) if args[:1] == ["--version"] else sys.version_info[:3]
    message = problem(version, required())
    if message:
        print(message, file=sys.stderr)
        raise SystemExit(2)


if __name__ == "__main__":
    main()
