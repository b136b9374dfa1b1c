"""MEDS reward shaping: error memory, clustering, penalties, background re-fits.

Names are imported lazily (PEP 562): the re-fit worker processes import
``medsrl.methods.meds.refit``, which needs only numpy and hdbscan, and should not pay for torch
(seconds per worker) just because this package re-exports the torch-based helpers. To export
a new name, add it to ``_EXPORTS`` (name -> submodule) instead of importing it here.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "NOISE": "clustering",
    "cluster_sizes": "clustering",
    "fit_cluster_labels": "clustering",
    "normalize_rows": "clustering",
    "predict_labels": "clustering",
    "single_cluster_sizes": "clustering",
    "top1_eigen_ratio": "clustering",
    "ErrorMemory": "memory",
    "MemoryEntry": "memory",
    "MemoryKey": "memory",
    "load_snapshot": "memory",
    "TARGETS": "penalty",
    "advantage_order_changed": "penalty",
    "apply_penalty": "penalty",
    "meds_penalty": "penalty",
    "BackgroundRefitter": "refit",
    "RefitError": "refit",
    "locate_answer": "answer_locator",
    "locate_answers": "answer_locator",
    "CaptureTargets": "logit_capture",
    "LayerLogitCapture": "logit_capture",
    "answer_targets": "logit_capture",
    "select_layers": "logit_capture",
    "AnswerFeatureReader": "features",
    "FeatureSpec": "features",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # let type checkers and IDEs see the names
    from medsrl.methods.meds.answer_locator import locate_answer, locate_answers  # noqa: F401
    from medsrl.methods.meds.clustering import (  # noqa: F401
        NOISE,
        cluster_sizes,
        fit_cluster_labels,
        normalize_rows,
        predict_labels,
        single_cluster_sizes,
        top1_eigen_ratio,
    )
    from medsrl.methods.meds.features import AnswerFeatureReader, FeatureSpec  # noqa: F401
    from medsrl.methods.meds.logit_capture import (  # noqa: F401
        CaptureTargets,
        LayerLogitCapture,
        answer_targets,
        select_layers,
    )
    from medsrl.methods.meds.memory import ErrorMemory, MemoryEntry, MemoryKey, load_snapshot  # noqa: F401
    from medsrl.methods.meds.penalty import (  # noqa: F401
        TARGETS,
        advantage_order_changed,
        apply_penalty,
        meds_penalty,
    )
    from medsrl.methods.meds.refit import BackgroundRefitter, RefitError  # noqa: F401
