"""A bar per benchmark while ``medsrl-eval`` samples: problems done, samples per second, ETA.
Paper-scale evaluations take hours; vLLM's own bar stays off (one per chunk would scroll)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from tqdm.auto import tqdm


def shows_progress(quiet: bool, stream: TextIO | None = None) -> bool:
    """A bar only on a terminal: a log file or CI gets the per-benchmark lines alone."""
    stream = sys.stderr if stream is None else stream
    return not quiet and hasattr(stream, "isatty") and stream.isatty()


class BenchmarkBar:
    """``run / bench: 37%|███▋  | 96/256 [01:54<03:10, 26.8 samples/s]``; problems read back from
    a resumed evaluation's store count as done without counting towards the rate."""

    def __init__(self, label: str, problems: int, samples_per_problem: int, enabled: bool,
                 stream: TextIO | None = None) -> None:
        self.bar = tqdm(total=problems, desc=label, unit="problem", disable=not enabled, leave=True,
                        file=sys.stderr if stream is None else stream, dynamic_ncols=True)
        self.samples_per_problem = samples_per_problem
        self.samples = 0
        self.seconds = 0.0
        self._started = time.monotonic()

    def stored(self, problems: int) -> None:
        self.bar.update(problems)
        self._started = time.monotonic()

    def sampled(self, problems: int) -> None:
        now = time.monotonic()
        self.samples += problems * self.samples_per_problem
        self.seconds += now - self._started
        self._started = now
        self.bar.set_postfix_str(f"{self.samples / max(self.seconds, 1e-9):.1f} samples/s", refresh=False)
        self.bar.update(problems)

    def close(self) -> None:
        self.bar.close()
