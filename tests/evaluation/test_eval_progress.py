"""medsrl-eval's bar per benchmark: on a terminal only, quiet on request; problems read back from
a resumed evaluation's store count as done but not towards samples per second."""

from __future__ import annotations

import io

from medsrl.evaluation.progress import BenchmarkBar, shows_progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_bar_only_on_a_terminal_and_not_when_quiet():
    assert shows_progress(False, Terminal())
    assert not shows_progress(True, Terminal())
    assert not shows_progress(False, io.StringIO())  # a pipe, a log file, CI


def test_the_bar_counts_problems_and_samples_per_second(monkeypatch):
    clock = iter([0.0, 0.0, 2.0, 4.0])
    monkeypatch.setattr("medsrl.evaluation.progress.time.monotonic", lambda: next(clock))
    out = Terminal()
    bar = BenchmarkBar("run / aime24", problems=30, samples_per_problem=16, enabled=True, stream=out)
    bar.stored(10)  # read back from generations.jsonl: no time counted
    bar.sampled(10)  # 160 samples in 2 s
    bar.sampled(10)  # 160 more in 2 s
    bar.close()
    text = out.getvalue()
    assert "run / aime24" in text and "30/30" in text and "80.0 samples/s" in text
    assert bar.samples == 320 and bar.seconds == 4.0


def test_a_disabled_bar_writes_nothing():
    out = Terminal()
    bar = BenchmarkBar("run / x", problems=4, samples_per_problem=2, enabled=False, stream=out)
    bar.sampled(4)
    bar.close()
    assert out.getvalue() == ""
