"""The files of ``src/medsrl`` one training step runs code in, and their lines (docs/ARCHITECTURE.md).

    .venv/bin/python benchmarks/step_route.py [hydra overrides ...]     # default: algorithm=grpo

Trains the tiny preset (``debug=fast``) for 2 steps and records, with ``sys.setprofile``, every
function of ``src/medsrl`` called inside the second ``RLModule.training_step`` (the first builds
what later steps reuse). The last line printed is one JSON object: the file count, their lines,
and each file with the functions called in it.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("MEDSRL_ROOT", str(ROOT))

from hydra import compose, initialize_config_dir  # noqa: E402

import medsrl  # noqa: E402
import medsrl.module  # noqa: E402
from medsrl.train import train  # noqa: E402

SRC = Path(medsrl.__file__).resolve().parent


def traced_step(calls: dict[str, set[str]]):
    """``RLModule.training_step`` that records ``calls`` (file -> functions) on its second call."""
    step = medsrl.module.RLModule.training_step
    count = [0]

    def record(frame, event, arg) -> None:
        path = frame.f_code.co_filename
        if event == "call" and path.startswith(str(SRC)):
            calls.setdefault(path, set()).add(frame.f_code.co_name)

    def training_step(self, *args, **kwargs):
        count[0] += 1
        if count[0] != 2:
            return step(self, *args, **kwargs)
        sys.setprofile(record)
        try:
            return step(self, *args, **kwargs)
        finally:
            sys.setprofile(None)

    return training_step


def main() -> None:
    overrides = sys.argv[1:] or ["algorithm=grpo"]
    out = tempfile.mkdtemp(prefix="medsrl-route-")
    calls: dict[str, set[str]] = {}
    medsrl.module.RLModule.training_step = traced_step(calls)
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("train", overrides=[f"paths.output_dir={out}", "debug=fast", "trainer.max_steps=2", "logger=csv",
                                          "callbacks.pass_at_k.every_n_steps=0", "export_policy=false", *overrides])
    train(cfg)
    files = {str(Path(p).relative_to(SRC.parent.parent)): sorted(f) for p, f in sorted(calls.items())}
    lines = sum(len((SRC.parent.parent / f).read_text().splitlines()) for f in files)
    print(json.dumps({"benchmark": "step_route", "overrides": overrides, "files": len(files), "lines": lines,
                      "calls": files}))


if __name__ == "__main__":
    main()
