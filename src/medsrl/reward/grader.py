"""Grade boxed answers against gold answers: normalise (``clean_answer``), decide the common cases
in-process (``quick_verdict``: identical strings, two plain numbers), then math-verify in worker
processes, killed past the per-answer timeout: sympy can hang on ``9^{9^{9^9}}``, a training step must
not (math-verify's own ``signal.alarm`` timeouts work in the main thread only).

Conventions: gold first (``verify(gold, answer)``: ``x=3`` equals ``3``); bare comma lists are sets,
parenthesised tuples ordered; ``62.5\\%`` equals ``62.5``, not ``0.625``; trailing ``\\text{}`` units
are dropped; two plain numbers compare exactly (``025`` is ``25``, ``27.0`` is ``27``, no tolerance).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import pickle
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from multiprocessing.connection import Connection, wait
from typing import Any

from medsrl.reward.answer_span import answer_text
from medsrl.reward.extract import extract_last_boxed
from medsrl.utils.lifetime import Owner, exit_with_owner, this_owner, without_main_import

log = logging.getLogger(__name__)

CompareFn = Callable[[str, str], bool]

_UNESCAPED_DOLLAR = re.compile(r"(?<!\\)\$")
# A LaTeX thousands separator between a digit and a group of exactly three digits:
# `10{,}080`, `10,\!080`, `11,\! 111`, `1\,000`.
_LATEX_THOUSANDS = re.compile(r"(?<=\d)(?:\{,\}|,\s*\\!|\\,)\s*(?=\d{3}(?!\d))")
# A whole answer that is one number written with plain comma separators: `58,500`, `-1,000.5`.
_PLAIN_THOUSANDS = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|°|\\degree(?![A-Za-z])")
# A unit written as text after a value: `5\text{ cm}`, `864 \mbox{ inches}^2`, `1.6 \mathrm{~cm}`.
# (Searched for at the end only, so the cost stays linear in the length of a runaway answer.)
_TRAILING_UNIT = re.compile(r"\\(?:text|textrm|mbox|mathrm|rm)\s*\{[^{}]*\}(?:\^\s*\{?\d\}?)?\s*$")
_WHOLE_TEXT = re.compile(r"^\\(?:text|textrm|textbf|mbox|mathrm)\s*\{([^{}]*)\}$")
_SCIENTIFIC = re.compile(r"^(?P<mantissa>[-+]?(?:\d+(?:\.\d*)?|\.\d+))[eE](?P<exponent>[-+]?\d+)$")
_PLAIN_NUMBER = re.compile(r"^[-+]?(?:\d+(?:\.\d*)?|\.\d+)$")
_MAX_FAST_NUMBER_CHARS = 200
# Comparison operators, rewritten to one-character tokens before matching a chained inequality.
_LESS_EQUAL = re.compile(r"\\(?:leqslant|leq|le)(?![A-Za-z])|≤")
_GREATER_EQUAL = re.compile(r"\\(?:geqslant|geq|ge)(?![A-Za-z])|≥")
_LESS = re.compile(r"\\lt(?![A-Za-z])")
_GREATER = re.compile(r"\\gt(?![A-Za-z])")
# The middle of `a<x<b`: a variable, optionally applied to a variable (`-80\le g(x)\le 82`).
_VARIABLE = r"[A-Za-z](?:\(\s*[A-Za-z]\s*\))?"
_CHAINED = re.compile(rf"^(?P<low>[^<>≤≥=]+?)\s*(?P<op1>[<≤])\s*{_VARIABLE}\s*(?P<op2>[<≤])\s*(?P<high>[^<>≤≥=]+)$")
_CHAINED_REVERSED = re.compile(
    rf"^(?P<high>[^<>≤≥=]+?)\s*(?P<op1>[>≥])\s*{_VARIABLE}\s*(?P<op2>[>≥])\s*(?P<low>[^<>≤≥=]+)$")
_ONE_SIDED = re.compile(rf"^{_VARIABLE}\s*(?P<op>[<>≤≥])\s*(?P<bound>[^<>≤≥=]+)$")
_ONE_SIDED_FLIPPED = re.compile(rf"^(?P<bound>[^<>≤≥=]+?)\s*(?P<op>[<>≤≥])\s*{_VARIABLE}$")
_FRAC_SHORTHAND = re.compile(r"\\frac\s*(\d|\{[^{}]*\})\s*(\d|\{[^{}]*\})")
_SQRT_SHORTHAND = re.compile(r"\\sqrt\s*(\d)")
_LEFT_RIGHT = re.compile(r"\\(?:left|right)(?![A-Za-z])")


def clean_answer(text: str) -> str:
    """Rewrite an answer (gold or extracted) into a form math-verify reads correctly (only
    unambiguous rewrites; conventions in the module docstring)."""
    s = text.strip()
    s = s.replace("\\$", "")  # currency, `\$18.90`
    s = _UNESCAPED_DOLLAR.sub("", s)  # math delimiters, `$\frac{1}{2}$` or `$69$,$84$`
    s = _strip_outer_delimiters(s)
    s = re.sub(r"\\[dt]frac(?![A-Za-z])", r"\\frac", s)
    s = s.replace("\\displaystyle", "")
    s = _LATEX_THOUSANDS.sub("", s)
    s = s.replace("\\!", "")
    s = _DEGREES.sub("", s)
    s = s.replace("\\%", "").replace("%", "")
    unit = _TRAILING_UNIT.search(s)
    if unit and any(char.isdigit() for char in s[: unit.start()]):
        s = s[: unit.start()]
    s = s.strip().rstrip(".").strip()  # trailing full stop: `3.` is `3`
    if _PLAIN_THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    scientific = _SCIENTIFIC.match(s)
    if scientific:  # `4.5e33` is the product 4.5*e*33 to math-verify
        s = f"{scientific['mantissa']}\\times 10^{{{scientific['exponent']}}}"
    return _inequality_to_interval(s)


def _strip_outer_delimiters(s: str) -> str:
    for open_, close in (("\\(", "\\)"), ("\\[", "\\]")):
        if s.startswith(open_) and s.endswith(close):
            return s[len(open_) : -len(close)].strip()
    return s


def _inequality_to_interval(s: str) -> str:
    """``a<x<b``, ``a\\le x\\le b``, ``x>a`` (and mirrored forms) become interval notation:
    math-verify does not always equate them (``x\\le 0`` with ``(-\\infty, 0]``)."""
    if not any(op in s for op in ("<", ">", "\\l", "\\g", "≤", "≥")):
        return s
    t = s
    for pattern, token in (_LESS_EQUAL, "≤"), (_GREATER_EQUAL, "≥"), (_LESS, "<"), (_GREATER, ">"):
        t = pattern.sub(token, t)
    if match := _CHAINED.match(t):
        low, high, low_op, high_op = match["low"], match["high"], match["op1"], match["op2"]
    elif match := _CHAINED_REVERSED.match(t):
        low, high, low_op, high_op = match["low"], match["high"], match["op2"], match["op1"]
    elif match := _ONE_SIDED.match(t):
        low, high, low_op, high_op = _one_sided(match["bound"], match["op"])
    elif match := _ONE_SIDED_FLIPPED.match(t):
        flipped = {"<": ">", ">": "<", "≤": "≥", "≥": "≤"}[match["op"]]
        low, high, low_op, high_op = _one_sided(match["bound"], flipped)
    else:
        return s
    opening = "[" if low_op in "≤≥" else "("
    closing = "]" if high_op in "≤≥" else ")"
    return f"{opening}{low.strip()}, {high.strip()}{closing}"


def _one_sided(bound: str, op: str) -> tuple[str, str, str, str]:
    """``x op bound`` as ``(low, high, low_op, high_op)`` with an infinite end."""
    if op in "<≤":
        return "-\\infty", bound, "<", op
    return bound, "\\infty", "<" if op == ">" else "≤", "<"


def _comparison_key(cleaned: str) -> str:
    """A purely cosmetic canonical form for the string fast path (never looser than math-verify)."""
    whole_text = _WHOLE_TEXT.match(cleaned)
    s = _LEFT_RIGHT.sub("", whole_text.group(1) if whole_text else cleaned)
    s = _FRAC_SHORTHAND.sub(lambda m: f"\\frac{_braced(m[1])}{_braced(m[2])}", s)
    s = _SQRT_SHORTHAND.sub(r"\\sqrt{\1}", s)
    s = re.sub(r"\\[,;:> ]|~", "", s)  # LaTeX spacing commands
    return "".join(s.split())


def _braced(token: str) -> str:
    return token if token.startswith("{") else "{" + token + "}"


def _as_number(key: str) -> Fraction | None:
    """The exact value of a plain decimal like ``025``, ``-3.5`` or ``.35``; ``None`` otherwise
    (runaway digit strings are left to the time-limited workers)."""
    if len(key) > _MAX_FAST_NUMBER_CHARS or not _PLAIN_NUMBER.match(key):
        return None
    return Fraction(key)


def quick_verdict(gold: str, answer: str) -> bool | None:
    """Decide the easy cases without sympy: ``True``/``False``, or ``None`` to ask math-verify.
    Two plain numbers are compared exactly, which settles the commonest wrong answers too."""
    gold_key = _comparison_key(clean_answer(gold))
    answer_key = _comparison_key(clean_answer(answer))
    if not gold_key or not answer_key:
        return False
    if gold_key == answer_key:
        return True
    gold_number, answer_number = _as_number(gold_key), _as_number(answer_key)
    if gold_number is not None and answer_number is not None:
        return gold_number == answer_number
    return None


def answers_equivalent(gold: str, answer: str) -> bool:
    """The full in-process comparison: fast path, then ``math_verify.verify(gold, answer)``, with
    no timeout (math-verify's signal alarms are off): ``MathGrader`` enforces one."""
    verdict = quick_verdict(gold, answer)
    return math_verify_equivalent(gold, answer) if verdict is None else verdict


def math_verify_equivalent(gold: str, answer: str) -> bool:
    """``verify(parse(gold), parse(answer))`` on cleaned, boxed strings, without the fast path."""
    from math_verify import parse, verify  # imported lazily: sympy is slow to import

    # math-verify warns once per process that its timeouts are off; we enforce our own
    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).setLevel(logging.ERROR)
    gold_parsed = parse(_boxed(clean_answer(gold)), parsing_timeout=None)
    answer_parsed = parse(_boxed(clean_answer(answer)), parsing_timeout=None)
    if not gold_parsed or not answer_parsed:
        return False
    return bool(verify(gold_parsed, answer_parsed, timeout_seconds=None))


def _boxed(cleaned: str) -> str:
    """Boxed, a bare ``025`` is an answer to math-verify rather than text to search for one."""
    return f"$\\boxed{{{cleaned}}}$"


@dataclass(frozen=True)
class GradeResult:
    score: float  # 1.0 correct, 0.0 otherwise
    extracted: str | None  # answer extracted from the response (None if no box)
    has_box: bool
    timed_out: bool = False
    error: str | None = None  # exception text if grading crashed (score 0)
    unclosed_reasoning: bool = False  # reasoning_end set and never written: no answer (score 0)


def gold_text(gold: object) -> str:
    """A gold answer as one string: lists joined with ", ", everything else through ``str``."""
    if isinstance(gold, (list, tuple)):
        return ", ".join(str(part) for part in gold)
    return str(gold)


def _compare(fn: Callable, *task: str) -> tuple[Any, bool, str | None]:
    """``(value, timed_out, error)`` of one task (a comparison or a custom reward): an exception
    scores 0 and is reported."""
    try:
        return fn(*task), False, None
    except Exception as exc:
        return False, False, f"{type(exc).__name__}: {exc}"


def _worker_main(conn: Connection, fn: Callable, owner: Owner) -> None:
    """Worker process loop: receive ``(gold, answer)``, send back :func:`_compare`'s result.
    Exits when ``owner`` (the process that started it) dies, even mid-comparison."""
    import signal

    exit_with_owner(owner)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    answers_equivalent("1", "\\frac{2}{2}")  # import and warm up sympy before reporting ready
    conn.send("ready")
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):  # parent went away
            return
        if task is None:
            return
        conn.send(_compare(fn, *task))


class _Worker:
    """One grading process and the task it is running (if any)."""

    def __init__(self, ctx: mp.context.BaseContext, fn: Callable, startup_timeout_s: float):
        self.conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(
            target=_worker_main, args=(child_conn, fn, this_owner()), daemon=True,
            name="medsrl-grader",
        )
        with without_main_import():
            self.process.start()
        child_conn.close()
        self.ready = False
        self.task: int | None = None
        self.deadline = time.monotonic() + startup_timeout_s

    def submit(self, index: int, gold: str, answer: str, timeout_s: float) -> None:
        self.conn.send((gold, answer))
        self.task = index
        self.deadline = time.monotonic() + timeout_s

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()

    def stop(self) -> None:
        """Ask politely, then kill: leaves no zombie either way."""
        with contextlib.suppress(OSError, ValueError):  # the worker may be gone already
            self.conn.send(None)
        self.process.join(timeout=1)
        self.kill()


class MathGrader:
    """Score responses 1.0 / 0.0 by their last boxed answer, with a hard per-answer timeout.

    ``num_workers`` 'spawn' processes (safe after torch started threads) run ``compare_fn`` for what
    ``quick_verdict`` cannot settle; one slower than ``timeout_s`` scores 0 (``timed_out``) and is
    replaced. ``num_workers=0`` grades in-process with NO timeout: for debugging only. A worker exits
    when its starter dies (``utils/lifetime.py``). ``reasoning_end``: see ``reward/answer_span.py``.
    ``reward_fn(response, gold)`` (``grader.reward``) replaces the whole grading, in the same workers.
    """

    def __init__(
        self,
        timeout_s: float = 5.0,
        num_workers: int = 1,
        compare_fn: CompareFn = answers_equivalent,
        startup_timeout_s: float = 120.0,
        reasoning_end: str | None = None,
        reward_fn: Callable[[str, str], float | GradeResult] | None = None,
    ):
        self.reward_fn = reward_fn
        if num_workers > 0:
            try:  # fail here, not at the first grade() deep inside a training step
                pickle.dumps(reward_fn or compare_fn)
            except Exception as exc:
                name = "reward_fn" if reward_fn else "compare_fn"
                raise ValueError(f"{name} must be a picklable top-level function: {exc}") from exc
        self.timeout_s = timeout_s
        self.num_workers = num_workers
        self.compare_fn = compare_fn
        self._task_fn = reward_fn or compare_fn  # what a worker runs
        self.startup_timeout_s = startup_timeout_s
        if reasoning_end is not None and not reasoning_end.strip():
            raise ValueError("reasoning_end must be a non-empty tag such as '</think>', or None")
        self.reasoning_end = reasoning_end
        stats = ("graded", "timeouts", "errors", "no_box", "fast_path", "unclosed_reasoning")
        self.stats: dict[str, int] = dict.fromkeys(stats, 0)
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._ctx = mp.get_context("spawn")

    def grade(self, response: str, gold: str) -> GradeResult:
        return self.grade_batch([response], [gold])[0]

    def grade_batch(self, responses: Sequence[str], golds: Sequence[str]) -> list[GradeResult]:
        """Grade many responses at once; slow comparisons run in parallel across workers. A gold
        may be a number (amc23's ``27.0``) or a list (olympiadbench's): see ``gold_text``."""
        if len(responses) != len(golds):
            raise ValueError(f"{len(responses)} responses but {len(golds)} gold answers")
        golds = [gold_text(g) for g in golds]
        if self.reward_fn is not None:
            return self._custom_rewards(responses, golds)
        results: list[GradeResult | None] = [None] * len(responses)
        spans = [answer_text(r, self.reasoning_end) for r in responses]
        extracted: list[str | None] = [None if s is None else extract_last_boxed(s) for s in spans]
        slow: list[int] = []
        for i, (answer, gold) in enumerate(zip(extracted, golds, strict=True)):
            if spans[i] is None:
                self.stats["unclosed_reasoning"] += 1
                results[i] = GradeResult(0.0, None, has_box=False, unclosed_reasoning=True)
            elif answer is None:
                self.stats["no_box"] += 1
                results[i] = GradeResult(0.0, None, has_box=False)
            elif (verdict := quick_verdict(gold, answer)) is None:
                slow.append(i)
            else:
                self.stats["fast_path"] += 1
                results[i] = GradeResult(float(verdict), answer, has_box=True)
        if slow:
            tasks = [(golds[i], extracted[i]) for i in slow]
            for i, (verdict, timed_out, error) in zip(slow, self._compare_many(tasks), strict=True):
                self.stats["timeouts"] += timed_out
                self.stats["errors"] += error is not None
                results[i] = GradeResult(float(bool(verdict)), extracted[i], True, timed_out=timed_out, error=error)
        self.stats["graded"] += len(responses)
        return results  # type: ignore[return-value]

    def _custom_rewards(self, responses: Sequence[str], golds: list[str]) -> list[GradeResult]:
        """``reward_fn(response, gold)`` for every response, in the workers with the same timeout and
        counts: a hang or an exception scores 0; a float keeps the last box for the logs."""
        results = []
        outcomes = self._compare_many(list(zip(responses, golds, strict=True)))
        for response, (value, timed_out, error) in zip(responses, outcomes, strict=True):
            if not (timed_out or error) and isinstance(value, GradeResult):
                results.append(value)
                continue
            answer = extract_last_boxed(response)
            try:
                score = 0.0 if timed_out or error else float(value)
            except (TypeError, ValueError):
                score, error = 0.0, f"the reward function returned {value!r}, not a number or a GradeResult"
            self.stats["timeouts"] += timed_out
            self.stats["errors"] += error is not None
            self.stats["no_box"] += answer is None
            results.append(GradeResult(score, answer, answer is not None, timed_out=timed_out, error=error))
        self.stats["graded"] += len(responses)
        return results

    def start(self) -> MathGrader:
        """Spawn the workers now, so their sympy import (seconds) runs while the model loads and
        the first steps generate, not inside a step. Returns the grader."""
        with self._lock:
            self._fill_pool()
        return self

    def close(self) -> None:
        """Stop all workers. Safe to call more than once; the grader restarts them if used again."""
        with self._lock:
            workers, self._workers = self._workers, []
            for worker in workers:
                worker.stop()

    def __enter__(self) -> MathGrader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown: best effort only
            self.close()

    def _compare_many(self, tasks: list[tuple[str, str]]) -> list[tuple[bool, bool, str | None]]:
        """``(verdict, timed_out, error)`` per ``(gold, answer)`` task."""
        if self.num_workers == 0:
            return [_compare(self._task_fn, *task) for task in tasks]
        with self._lock:
            self._fill_pool()
            try:
                return self._run_tasks(tasks)
            except BaseException:
                # Workers may hold tasks of this batch; their late answers must not leak into the
                # next call, so start again from a clean pool (also on KeyboardInterrupt).
                for worker in self._workers:
                    worker.kill()
                self._workers = []
                raise

    def _fill_pool(self) -> None:
        while len(self._workers) < self.num_workers:
            self._workers.append(_Worker(self._ctx, self._task_fn, self.startup_timeout_s))

    def _run_tasks(self, tasks: list[tuple[str, str]]) -> list[tuple[bool, bool, str | None]]:
        """Hand tasks one at a time to idle workers; kill any worker that overruns its deadline.
        One task in flight per worker keeps the deadline exact (a pipe round trip is cheap)."""
        results: list[tuple[bool, bool, str | None] | None] = [None] * len(tasks)
        pending = deque(range(len(tasks)))
        while True:
            for slot, worker in enumerate(self._workers):
                if worker.ready and worker.task is None and pending:
                    index = pending.popleft()
                    try:
                        worker.submit(index, *tasks[index], timeout_s=self.timeout_s)
                    except OSError:  # the idle worker died (e.g. OOM-killed): retry on a new one
                        pending.appendleft(index)
                        self._replace(slot)
            if not pending and all(w.task is None for w in self._workers):
                break  # a replacement may still be starting; the next call picks it up
            waiting = [w for w in self._workers if w.task is not None or not w.ready]
            next_deadline = min(w.deadline for w in waiting)
            ready_conns = wait([w.conn for w in waiting], max(0.0, next_deadline - time.monotonic()))
            for slot, worker in enumerate(self._workers):
                if worker.conn in ready_conns:
                    self._receive(slot, worker, results)
            now = time.monotonic()
            for slot, worker in enumerate(self._workers):
                if worker.deadline <= now and (worker.task is not None or not worker.ready):
                    self._handle_overrun(slot, worker, results)
        return results  # type: ignore[return-value]

    def _receive(self, slot: int, worker: _Worker, results: list) -> None:
        try:
            message = worker.conn.recv()
        except (EOFError, OSError):
            worker.process.join(timeout=5)
            reason = f"grader worker died (exit code {worker.process.exitcode})"
            if worker.task is None:  # died while starting: the environment is broken, say so
                raise RuntimeError(reason + " during startup") from None
            results[worker.task] = (False, False, reason)
            self._replace(slot)
            return
        if message == "ready":
            worker.ready = True
            return
        results[worker.task] = message
        worker.task = None

    def _handle_overrun(self, slot: int, worker: _Worker, results: list) -> None:
        if worker.task is None:  # never became ready
            raise RuntimeError(f"grader worker not ready after {self.startup_timeout_s} s")
        log.warning("grading timed out after %.1f s; replacing the worker", self.timeout_s)
        results[worker.task] = (False, True, None)
        self._replace(slot)

    def _replace(self, slot: int) -> None:
        self._workers[slot].kill()
        self._workers[slot] = _Worker(self._ctx, self._task_fn, self.startup_timeout_s)
