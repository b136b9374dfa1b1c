"""Time of the MEDS HDBSCAN re-fits, synchronous vs in background workers, and their overlap.

    .venv/bin/python benchmarks/cluster_refit.py [--keys 512] [--points 256 2048] [--workers 1]

For each store size it times re-fitting ``--keys`` keys of ``--points`` features (14 floats,
a few Gaussian blobs per key plus scattered noise, shaped like per-layer answer-token logits):

- ``sync_s``: one after the other in this process (the reference order);
- ``background_s``: submit all to ``BackgroundRefitter`` (process pool), then ``drain``;
- overlap, per executor (``process``, ``thread``), on about ``--overlap-seconds`` of keys: a fixed
  torch matmul workload (sized to take about as long as those fits) runs in the main thread
  while the re-fits run in the background. ``matmul_alone_s`` and ``fit_alone_s`` are each on
  its own; ``matmul_with_fits_s`` is the workload's time beside the fits, ``total_s`` until both
  are done. ``overlap`` = (alone sum - total) / min(alone): 1 = perfect overlap, 0 = serial.
  Then a dispatch-bound loop of tiny torch ops (the CPU side of a GPU step, which needs the GIL
  for every op) runs beside the same fits: ``dispatch_rate_vs_alone`` is its op rate relative
  to running alone (1 = unaffected).

Progress goes to stderr; the last stdout line is one JSON object. The default run takes about
2-3 minutes on 2 busy cores.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from importlib.metadata import version

import numpy as np
import torch

from medsrl.features.clustering import fit_cluster_labels
from medsrl.methods.meds.refit import BackgroundRefitter

DIM = 14


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def synthetic_store(rng: np.random.Generator, n: int) -> np.ndarray:
    """[n, 14] float32: 2-5 blobs of repeated answers around a rising per-layer logit profile,
    plus ~10 % scattered one-off answers."""
    trend = np.linspace(2.0, 22.0, DIM)
    k = int(rng.integers(2, 6))
    centres = trend + rng.normal(0, 2.5, (k, DIM))
    weights = rng.dirichlet(np.ones(k))
    x = centres[rng.choice(k, n, p=weights)] + rng.normal(0, 0.4, (n, DIM))
    noisy = rng.random(n) < 0.1
    x[noisy] = trend + rng.normal(0, 4.0, (int(noisy.sum()), DIM))
    return x.astype(np.float32)


class Matmul:
    """Fixed CPU workloads for the main thread: chained 256x256 matmuls (compute-bound, a CPU
    training step) and a loop of tiny 64x64 ops (dispatch-bound: the CPU side of a GPU training
    loop, which needs the GIL for every op)."""

    def __init__(self, size: int = 256) -> None:
        g = torch.Generator().manual_seed(0)
        self.a = torch.randn(size, size, generator=g) / size**0.5
        self.small = torch.randn(64, 64, generator=g)

    def run(self, iters: int) -> float:
        t0 = time.perf_counter()
        x = self.a
        for _ in range(iters):
            x = torch.tanh(x @ self.a)
        return time.perf_counter() - t0

    def dispatch_rate(self, seconds: float) -> float:
        """Tiny ops per second over ``seconds`` of wall time."""
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            (self.small @ self.small).relu_()
            n += 1
        return n / (time.perf_counter() - t0)


def timed_background(refitter: BackgroundRefitter, stores: list[np.ndarray]) -> float:
    t0 = time.perf_counter()
    for i, x in enumerate(stores):
        refitter.submit(i, x)
    out = refitter.drain()
    assert len(out) == len(stores)
    return time.perf_counter() - t0


def overlap(kind: str, stores, workers: int, matmul: Matmul, iters: int, alone: dict) -> dict:
    with BackgroundRefitter(num_workers=workers, executor=kind) as rf:
        rf.submit("warm", stores[0])
        rf.drain()
        t0 = time.perf_counter()
        for i, x in enumerate(stores):
            rf.submit(i, x)
        mm = matmul.run(iters)
        rf.drain()
        total = time.perf_counter() - t0
        for i, x in enumerate(stores):  # the dispatch-bound workload beside the same fits
            rf.submit(i, x)
        rate = matmul.dispatch_rate(alone["dispatch_seconds"])
        still_running = sum(not rf.ready(i) for i in range(len(stores)))
        rf.drain()
    serial = alone["matmul_alone_s"] + alone["fit_alone_s"]
    return {
        "matmul_with_fits_s": round(mm, 3),
        "total_s": round(total, 3),
        "overlap": round((serial - total) / min(alone["matmul_alone_s"], alone["fit_alone_s"]), 3),
        "dispatch_rate_vs_alone": round(rate / alone["dispatch_per_s"], 3),
        "fits_still_running_after_dispatch": still_running,
    }


def bench(points: int, args, rng: np.random.Generator, matmul: Matmul) -> dict:
    stores = [synthetic_store(rng, points) for _ in range(args.keys)]
    res: dict = {}

    log(f"[{points}] sync: {args.keys} keys")
    fit_cluster_labels(stores[0])  # warm: the first call imports hdbscan (seconds)
    t0 = time.perf_counter()
    labels = [fit_cluster_labels(x) for x in stores]
    res["sync_s"] = round(time.perf_counter() - t0, 3)
    res["sync_ms_per_key"] = round(1000 * res["sync_s"] / args.keys, 2)
    res["mean_clusters"] = round(float(np.mean([lab.max() + 1 for lab in labels])), 2)
    res["mean_noise_frac"] = round(float(np.mean([(lab < 0).mean() for lab in labels])), 3)
    log(f"[{points}] sync {res['sync_s']} s")

    t0 = time.perf_counter()
    with BackgroundRefitter(num_workers=args.workers) as rf:
        rf.submit("warm", stores[0])
        rf.drain()
        res["pool_start_s"] = round(time.perf_counter() - t0, 3)
        res["background_s"] = round(timed_background(rf, stores), 3)
    log(f"[{points}] background (process, {args.workers} worker) {res['background_s']} s")

    # enough keys for about --overlap-seconds of fitting, so both workloads run a while
    sub = stores[: int(np.clip(args.overlap_seconds * args.keys / res["sync_s"], 1, args.keys))]
    t0 = time.perf_counter()
    for x in sub:
        fit_cluster_labels(x)
    fit_alone = time.perf_counter() - t0
    per_iter = matmul.run(50) / 50
    iters = max(1, int(fit_alone / per_iter))
    dispatch_seconds = min(3.0, 0.5 * fit_alone)  # the fits outlast the dispatch loop
    alone = {
        "matmul_alone_s": matmul.run(iters),
        "fit_alone_s": fit_alone,
        "dispatch_seconds": dispatch_seconds,
        "dispatch_per_s": matmul.dispatch_rate(dispatch_seconds),
    }
    res["overlap_keys"] = len(sub)
    res["matmul_iters"] = iters
    res.update({k: round(v, 3) for k, v in alone.items()})
    for kind in ("process", "thread"):
        res[f"overlap_{kind}"] = overlap(kind, sub, args.workers, matmul, iters, alone)
        log(
            f"[{points}] overlap {kind}: {res[f'overlap_{kind}']} (alone: {res['matmul_alone_s']}"
            f" s matmul, {res['fit_alone_s']} s fits)"
        )
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, default=512)
    ap.add_argument("--points", type=int, nargs="+", default=[256, 2048])
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--overlap-seconds", type=float, default=3.0)
    ap.add_argument("--torch-threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.torch_threads)
    rng = np.random.default_rng(args.seed)
    matmul = Matmul()
    t0 = time.perf_counter()
    results = {str(p): bench(p, args, rng, matmul) for p in args.points}
    print(
        json.dumps(
            {
                "benchmark": "cluster_refit",
                "keys": args.keys,
                "dim": DIM,
                "workers": args.workers,
                "torch_threads": args.torch_threads,
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "hdbscan": version("hdbscan"),
                "wall_s": round(time.perf_counter() - t0, 1),
                "results": results,
            }
        )
    )


if __name__ == "__main__":
    main()
