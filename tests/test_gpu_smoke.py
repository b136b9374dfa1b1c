"""``benchmarks/gpu_smoke.py --toy``: the GPU smoke run's CPU version, so the script does not rot.

The real run needs one CUDA GPU (``make gpu-smoke``); here the same code path runs the 1.5B
experiment's config at a narrow width with the shared Qwen tokenizer and checks its JSON.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from run_helpers import ROOT
from shared_paths import require_shared

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("cpu_bf16_gemms")]


def _smoke_module():
    spec = importlib.util.spec_from_file_location("gpu_smoke", ROOT / "benchmarks" / "gpu_smoke.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_toy_smoke_run_writes_every_figure(tmp_path):
    tok = require_shared("tokenizers", "qwen2.5-math")
    out = tmp_path / "smoke.json"
    result = _smoke_module().main(["--toy", "--tokenizer", str(tok), "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["backend"] == "hf" and result["precision"] == "bf16-mixed" and result["layers"] == 2
    assert result["engine_is_cap"] == 2.0 and result["max_tokens_per_microbatch"] == 256
    assert result["steps_done"] == 2 and [s["step"] for s in result["steps"]] == [0, 1]
    for step in result["steps"]:
        for key in ("time/generate", "time/logprob", "time/update", "time/step", "generated_tokens_per_s",
                    "trainer_tokens_per_s", "padding/update_frac", "engine/logprob_diff_mean",
                    "engine_is/weight_mean"):
            assert key in step, key
        assert step["weights_changed_frac"] > 0.99  # the update moved (nearly) every matrix weight
        # the HF engine is the trainer's own module: the IS weights are 1 up to KV-cache numerics
        assert step["engine_is/weight_mean"] == pytest.approx(1.0, abs=1e-3)
        assert step["nonfinite_updates"] == 0
