"""``grader``: math grading in worker processes with a hard timeout per answer."""

import functools
import os
from typing import Annotated, Any

from medsrl.settings import Count, NonEmpty, Positive, Settings, must, nullable

MAX_GRADER_WORKERS = 16


class GraderConfig(Settings):
    """Math grading: hard per-answer timeout, in worker processes."""

    timeout_s: Positive = 5.0
    """The hard limit on grading one answer (math-verify can hang on adversarial input)."""
    num_workers: nullable(Count) = None
    """None: grader_workers(), one per core of this process; 0: in-process, no timeout (debugging)."""
    reasoning_end: Annotated[NonEmpty | None, must("a non-empty tag such as '</think>', or null")] = None
    """Reasoning models (R1-Distill, Qwen3 thinking): grade only the text after the last occurrence
    of this tag; a response that never writes it scores 0 (counted). None: all of it."""
    reward: Annotated[dict[str, Any] | None, must("{_target_: module.function, keyword: value, ...} or null")] = None
    """A reward function instead of math grading (reward=<configs/reward/ preset>): called as
    f(response, gold, **keywords) -> float | GradeResult in the grader's workers, with its timeout."""

    def reward_function(self):
        """``reward``'s function with its keywords bound; None: math grading. Fails here, naming
        the key, if the target does not import."""
        if self.reward is None:
            return None
        from hydra.utils import get_method

        target = self.reward.get("_target_")
        try:
            fn = get_method(target)
        except Exception as exc:
            raise ValueError(f"grader.reward._target_={target!r} is not an importable function: {exc}") from exc
        return functools.partial(fn, **{k: v for k, v in self.reward.items() if not k.startswith("_")})

    def grader(self, workers: int):
        """The grader these settings describe, its workers started."""
        from medsrl.reward.grader import MathGrader

        return MathGrader(timeout_s=self.timeout_s, num_workers=workers, reasoning_end=self.reasoning_end,
                          reward_fn=self.reward_function()).start()

    def workers(self, processes_per_node: int = 1) -> int:
        """The worker count: the configured one, else :func:`grader_workers`."""
        return self.num_workers if self.num_workers is not None else grader_workers(processes_per_node)


def grader_workers(processes_per_node: int = 1) -> int:
    """One grader worker per core this process may use, the node's cores split between its
    training processes, at most ``MAX_GRADER_WORKERS``: math-verify is CPU-bound, and grading
    runs between generation and the update, when the cores are otherwise idle."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(MAX_GRADER_WORKERS, cores // max(1, processes_per_node)))

