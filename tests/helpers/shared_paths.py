"""Where tests find the benchmark data and the Qwen tokenizer.

``SHARED_DIR`` is ``$MEDSRL_SHARED_DIR`` or ``<repo root>/../shared``. Data files are looked up
where a run reads them (``paths.data_dir``): ``$MEDSRL_DATA_DIR``, the shared folder's ``data/``,
then the repo's ``data/`` that ``make data`` fills, so a clone with ``make data`` done runs the
data tests. :func:`require_shared` skips a test whose file is absent, except on CI
(``CI=true``), where absence is a failure. Import as ``from shared_paths import SHARED_DIR,
require_shared`` (``tests/helpers`` is on pytest's ``pythonpath``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SHARED_DIR = Path(os.environ.get("MEDSRL_SHARED_DIR", REPO_ROOT.parent / "shared"))


def data_dirs() -> list[Path]:
    """The folders a data file may be in, first match wins (as ``configs/paths``)."""
    own = [Path(os.environ["MEDSRL_DATA_DIR"])] if os.environ.get("MEDSRL_DATA_DIR") else []
    return [*own, SHARED_DIR / "data", REPO_ROOT / "data"]


def data_dir() -> Path:
    """The first of :func:`data_dirs` that exists (the shared one when none does)."""
    return next((d for d in data_dirs() if d.is_dir()), SHARED_DIR / "data")


def require_shared(*relative_parts: str) -> Path:
    """The file or folder ``relative_parts`` (``"data", ...``: in :func:`data_dirs`; else under
    ``SHARED_DIR``) if it exists; otherwise skip the test (fail on CI)."""
    if relative_parts[:1] == ("data",):
        places = [d.joinpath(*relative_parts[1:]) for d in data_dirs()]
    else:
        places = [SHARED_DIR.joinpath(*relative_parts)]
    found = next((p for p in places if p.exists()), None)
    if found is not None:
        return found
    message = (
        f"not found: {' or '.join(map(str, places))}; set MEDSRL_SHARED_DIR to the folder holding "
        "data/ and tokenizers/ (default: <repo>/../shared), or MEDSRL_DATA_DIR, or run `make data`"
    )
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)
