"""Where tests find ``../shared`` (benchmark data, the Qwen tokenizer).

``SHARED_DIR`` is ``$MEDSRL_SHARED_DIR`` or ``<repo root>/../shared``. :func:`require_shared`
skips a test whose file is absent, except on CI (``CI=true``), where absence is a failure.
Import as ``from shared_paths import SHARED_DIR, require_shared`` (``tests`` is on pytest's
``pythonpath``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SHARED_DIR = Path(os.environ.get("MEDSRL_SHARED_DIR", REPO_ROOT.parent / "shared"))


def require_shared(*relative_parts: str) -> Path:
    """``SHARED_DIR / relative_parts`` if it exists; otherwise skip the test (fail on CI)."""
    path = SHARED_DIR.joinpath(*relative_parts)
    if path.exists():
        return path
    message = (
        f"shared file not found: {path}; set MEDSRL_SHARED_DIR to the folder holding "
        f"data/ and tokenizers/ (default: <repo>/../shared)"
    )
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)
