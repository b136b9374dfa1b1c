"""Where a callback or plug-in writes its files."""

from __future__ import annotations


def run_log_dir(trainer) -> str:
    """The first logger's directory, else the trainer's root dir: unlike ``trainer.log_dir`` (a
    broadcast under DDP, which deadlocks when only rank 0 asks), no collective call."""
    for logger in trainer.loggers:
        if getattr(logger, "log_dir", None):
            return str(logger.log_dir)
    return str(trainer.default_root_dir)
