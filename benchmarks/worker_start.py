"""Start-up of the grader's and the MEDS re-fit's workers from a training process, with and without
``utils/lifetime.without_main_import``.

    .venv/bin/python benchmarks/worker_start.py [--rounds 3] [--toy]

This script is the ``__main__`` and imports ``medsrl.train`` (Lightning, transformers) as
``medsrl-train`` does. Each round, interleaved, times with fresh workers:
``grader_s`` from a ``MathGrader(num_workers=1)`` to the first answer graded by a worker (sympy), and
``refit_s`` from a ``BackgroundRefitter(num_workers=1)`` to the first fit collected; ``as_shipped``
starts the workers under ``without_main_import``, ``main_reimported`` the way they started before
(the child re-runs this ``__main__`` first). The last stdout line is one JSON object: every round's
seconds and the median ratio. ``--toy`` (the test suite's run): one round, as shipped only (a
re-imported start costs a ``medsrl.train`` import, ~10 s, per worker); no ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import time

import numpy as np

import medsrl.methods.meds.refit as refit
import medsrl.reward.grader as grader
import medsrl.train  # noqa: F401  (the heavy __main__ a training run has)


def one_round(reimport: bool) -> dict[str, float]:
    patch = (lambda: contextlib.nullcontext()) if reimport else None
    for module in (grader, refit):  # both import the name; put the shipped one back after
        module._saved = module.without_main_import
        if patch:
            module.without_main_import = patch
    try:
        t0 = time.perf_counter()
        with grader.MathGrader(num_workers=1, timeout_s=600) as g:
            (result,) = g.grade_batch(["\\boxed{\\sqrt{4}}"], ["2"])
        grader_s = time.perf_counter() - t0
        assert result.score == 1.0, result
        t0 = time.perf_counter()
        with refit.BackgroundRefitter(num_workers=1) as pool:
            pool.submit("k", np.random.default_rng(0).normal(size=(64, 14)))
            pool.wait("k")
        refit_s = time.perf_counter() - t0
    finally:
        for module in (grader, refit):
            module.without_main_import = module._saved
    return {"grader_s": round(grader_s, 2), "refit_s": round(refit_s, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--toy", action="store_true", help="one round, as shipped only")
    args = ap.parse_args()
    rounds = {"as_shipped": []} if args.toy else {"as_shipped": [], "main_reimported": []}
    for r in range(1 if args.toy else args.rounds):
        for name in rounds:  # interleaved: the machine's noise falls on both
            rounds[name].append(one_round(reimport=name == "main_reimported"))
            print(f"round {r} {name}: {rounds[name][-1]}", file=sys.stderr, flush=True)
    ratio = None if args.toy else {
        k: statistics.median(b[k] / a[k] for a, b in zip(rounds["as_shipped"], rounds["main_reimported"], strict=True))
        for k in ("grader_s", "refit_s")}
    print(json.dumps({"rounds": rounds, "median_ratio_reimported_over_shipped": ratio,
                      "machine": platform.processor() or platform.machine()}))


if __name__ == "__main__":
    main()
