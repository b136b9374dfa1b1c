"""Re-running a multirun into its own directories (``skip_if_done``): what makes a run that run,
the check that a directory holds a run of the same settings, and a finished run's summary."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from medsrl.utils.atomic_file import atomic_write

# Keys that may differ between an interrupted run and its re-run without changing what it computes.
_IDENTITY_EXEMPT = ("hydra", "paths", "logger", "skip_if_done", "ckpt_path", "resume_mode", "optimized_metric")
# Display only, also inside a section: the progress bar (added after runs were stored).
_IDENTITY_EXEMPT_KEYS = (("callbacks", "progress_bar"), ("trainer", "enable_progress_bar"))


def run_identity(cfg: DictConfig) -> dict[str, Any]:
    """What makes a run this run: its config without paths and resume keys, unresolved (so no
    time stamp or directory enters). A re-run compares it with the one stored in its dir."""
    container = OmegaConf.to_container(cfg, resolve=False)
    identity = {k: v for k, v in container.items() if k not in _IDENTITY_EXEMPT}
    for section, key in _IDENTITY_EXEMPT_KEYS:
        if isinstance(identity.get(section), dict):
            identity[section].pop(key, None)
    return identity


def check_identity(cfg: DictConfig, out_dir: Path) -> None:
    """Fail when ``out_dir`` holds a run of other settings (an Optuna study kept in a database
    asks other trials on a re-run): skipping or resuming it would report the wrong run."""
    path = out_dir / "run_identity.json"
    mine = json.loads(json.dumps(run_identity(cfg)))  # tuples -> lists, as stored
    if path.exists():
        stored = json.loads(path.read_text())
        mine = _settings_known_to(stored, mine)
        if stored != mine:
            diff = sorted(_diff_keys(stored, mine))
            raise ValueError(
                f"skip_if_done: {out_dir} holds a run of other settings (differ: {diff[:10]}); "
                "re-run into a new hydra.sweep.dir / hydra.run.dir, or delete that run"
            )
    elif _is_rank_zero():
        data = json.dumps(mine, indent=2, sort_keys=True).encode()
        atomic_write(path, lambda f: f.write(data))


def _settings_known_to(stored: Any, mine: Any) -> Any:
    """``mine`` without the settings ``stored`` does not have: keys added to the code since that
    run was stored (``data.template.kind``, ``model.lora``) leave it the same run."""
    if isinstance(stored, dict) and isinstance(mine, dict):
        return {k: _settings_known_to(stored[k], v) for k, v in mine.items() if k in stored}
    return mine


def _diff_keys(a: Any, b: Any, prefix: str = "") -> list[str]:
    """Dotted keys at which two nested dicts differ (for the error message)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [k for key in sorted(set(a) | set(b), key=str)
                for k in _diff_keys(a.get(key), b.get(key), f"{prefix}{key}.")]
    return [] if a == b else [prefix.rstrip(".")]


def _is_rank_zero() -> bool:
    """Before the trainer exists: rank 0 of a DDP launch (Lightning sets ``RANK`` for the others)."""
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))) == 0


def finished_summary(out_dir: Path) -> dict[str, float] | None:
    """The summary of a run that completed in ``out_dir`` (written last, atomically), else None."""
    try:
        summary = json.loads((out_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) else None
