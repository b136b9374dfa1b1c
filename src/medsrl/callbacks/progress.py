"""A progress bar that counts RL steps: ``step 37/60 |████▉   | [01:54<01:11, 3.1s/step, reward=0.412, acc=0.375]``
(Lightning's counts epochs: "Epoch 0/-2 ... 0.03it/s"). It says ``validating`` while validation samples.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from typing import Annotated, Any

from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm
from typing_extensions import Doc

from medsrl.settings import Count, Flag, PositiveInt

BAR_FORMAT = "step {n_fmt}/{total_fmt} |{bar}| [{elapsed}<{remaining}{postfix}]"
BAR_FORMAT_NO_TOTAL = "step {n_fmt} [{elapsed}{postfix}]"  # max_steps=-1: no total, no ETA
PREFIX = "train/"  # dropped from the metric names
STEP_TIME_METRIC = "train/time/step"  # the module's own step time (its training_step alone)


class StepProgressBar(TQDMProgressBar):
    """``step <n>/<max_steps>``, seconds per step (mean of the last ``window``), ``prog_bar`` metrics."""

    def __init__(self, refresh_rate: Annotated[Count, Doc("redraw every N steps; 0: no bar")] = 1,
                 process_position: Annotated[Count, Doc("tqdm's line, for several bars")] = 0,
                 window: Annotated[PositiveInt, Doc("s/step: the mean of the last N steps (validation not "
                                                    "counted)")] = 10,
                 leave: Annotated[Flag, Doc("keep the bar when done")] = True) -> None:
        super().__init__(refresh_rate=refresh_rate, process_position=process_position, leave=leave)
        self._step_times: deque[float] = deque(maxlen=window)
        self._step_start: float | None = None
        self._started = False  # the first step began (the clock restarts then)
        self._closed = False
        self._status = ""

    def seconds_per_step(self) -> float | None:
        return sum(self._step_times) / len(self._step_times) if self._step_times else None

    def postfix(self, trainer) -> str:
        sps = self.seconds_per_step()
        parts = [] if sps is None else [f"{sps:.{2 if sps < 1 else 1 if sps < 100 else 0}f}s/step"]
        for name, value in self.get_metrics(trainer, trainer.lightning_module).items():
            parts.append(f"{name}={value:.3f}" if isinstance(value, float) else f"{name}={value}")
        return ", ".join([*parts, self._status] if self._status else parts)

    def get_metrics(self, trainer, pl_module) -> dict[str, Any]:
        return {k.removeprefix(PREFIX): v for k, v in trainer.progress_bar_metrics.items()}

    def set_status(self, text: str) -> None:
        """A word after the metrics (``""`` clears it); before the first step this opens the bar."""
        self._status = text
        if self._trainer is None or self._closed:
            return
        if self._train_progress_bar is None:
            self._open()
        bar = self.train_progress_bar
        if not bar.disable:
            if not self._started:
                self._restart_clock(bar)  # the clock runs from the first step on
            self._draw(self._trainer)

    def _draw(self, trainer, refresh: bool = True) -> None:
        bar = self.train_progress_bar
        bar.n = trainer.global_step
        bar.set_postfix_str(self.postfix(trainer), refresh=refresh)

    def init_train_tqdm(self) -> Tqdm:
        max_steps = self.trainer.max_steps
        total = max_steps if max_steps is not None and max_steps > 0 else None
        return Tqdm(total=total, initial=self.trainer.global_step, position=2 * self.process_position,
                    disable=self.is_disabled, leave=self._leave, dynamic_ncols=True, file=sys.stdout,
                    smoothing=0, bar_format=BAR_FORMAT if total is not None else BAR_FORMAT_NO_TOTAL)

    def init_sanity_tqdm(self) -> Tqdm:
        return Tqdm(disable=True)  # no second bar: the module has no validation_step

    init_validation_tqdm = init_sanity_tqdm

    def _open(self) -> None:
        self._step_times.clear()
        self._started = False
        self._closed = False
        self.train_progress_bar = self.init_train_tqdm()

    def _close(self, trainer) -> None:
        if self._closed or self._train_progress_bar is None:
            return
        bar = self.train_progress_bar
        self._status = ""
        if not bar.disable:
            self._draw(trainer, refresh=False)
        bar.close()  # leave=True: the last line stays, then a new line
        self._closed = True

    def on_train_start(self, trainer, pl_module) -> None:
        if self._train_progress_bar is None or self._closed:
            self._open()  # else opened already by a validation before the first step

    def on_train_epoch_start(self, trainer, *_: Any) -> None:
        pass  # no epochs here: the bar is the run's

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        pass  # the parent closes its bar per epoch; this one lasts the run

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        self._step_start = time.monotonic()
        bar = self._train_progress_bar
        if not self._started and bar is not None and not bar.disable:
            self._restart_clock(bar)  # the validation before step 1 is not a step
        self._started = True

    @staticmethod
    def _restart_clock(bar: Tqdm) -> None:
        bar.start_t = bar.last_print_t = bar._time()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self._step_times.append(self._step_seconds(trainer))
        self._step_start = None
        bar = self._train_progress_bar
        if bar is None or bar.disable or self._closed:
            return
        n = trainer.global_step
        if n == bar.total:
            self._close(trainer)  # before Lightning's "`Trainer.fit` stopped" line, not under it
        elif self.is_enabled and n % self.refresh_rate == 0:
            self._draw(trainer)

    def _step_seconds(self, trainer) -> float:
        value = trainer.callback_metrics.get(STEP_TIME_METRIC)
        if value is not None:
            return float(value)
        return time.monotonic() - self._step_start if self._step_start is not None else 0.0

    def on_train_end(self, trainer, pl_module) -> None:
        self._close(trainer)


def set_progress_status(trainer, text: str) -> None:
    """Tell the run's step bar what happens between steps (``validating``); no-op without one."""
    bar = getattr(trainer, "progress_bar_callback", None)
    if isinstance(bar, StepProgressBar):
        bar.set_status(text)
