"""What the run sends to Weights & Biases besides Lightning's metrics: the plug-ins' histograms
and text, where it writes, its summary. ``wandb`` is optional: imported only with a ``WandbLogger``.
"""

from __future__ import annotations

import html
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def wandb_loggers(loggers: Iterable[Any]) -> list[Any]:
    """The ``WandbLogger``s among ``loggers`` (Lightning's class does not import wandb)."""
    from lightning.pytorch.loggers import WandbLogger

    return [lg for lg in loggers if isinstance(lg, WandbLogger)]


def log_histogram(loggers: Iterable[Any], tag: str, values: Any, step: int) -> None:
    targets = wandb_loggers(loggers)
    if not targets:
        return
    import numpy as np
    import torch
    import wandb

    array = np.asarray(torch.as_tensor(values).detach().float().cpu().reshape(-1))
    if array.size == 0:
        return
    for lg in targets:
        lg.log_metrics({tag: wandb.Histogram(array)}, step=step)


def log_text(loggers: Iterable[Any], tag: str, text: str, step: int) -> None:
    """``text`` as a preformatted HTML panel at ``step`` (W&B has no plain text panel)."""
    targets = wandb_loggers(loggers)
    if not targets:
        return
    import wandb

    panel = wandb.Html(f"<pre style='white-space: pre-wrap'>{html.escape(text)}</pre>")
    for lg in targets:
        lg.log_metrics({tag: panel}, step=step)


def describe(logger: Any) -> str:
    """One line on where a W&B run writes and how to upload it (starts the run: rank 0 only)."""
    run = logger.experiment
    where = Path(run.settings.sync_dir)  # <save_dir>/wandb/offline-run-<time>-<id>
    if getattr(run, "offline", False):
        return f"[medsrl] WandbLogger (offline) run {run.id}: {where}  (upload: wandb sync {where})"
    return f"[medsrl] WandbLogger run {run.id}: {getattr(run, 'url', None) or where}"


def finish(loggers: Iterable[Any], summary: dict[str, Any] | None = None, exit_code: int = 0) -> None:
    """Put the summary into each open W&B run and finish it (rank 0): W&B would reuse an unfinished
    run for the next ``WandbLogger`` of this process."""
    for lg in wandb_loggers(loggers):
        run = getattr(lg, "_experiment", None)  # never start a run only to finish it
        if run is None or not hasattr(run, "finish"):
            continue
        if summary:
            run.summary.update({k: v for k, v in summary.items() if isinstance(v, (int, float, str, bool))})
        run.finish(exit_code=exit_code)
