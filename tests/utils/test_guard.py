"""The runaway guard: the pure checks, the sampling error, the checkpoint refusal, and real
``debug=fast`` runs with ``optim.optimizer.lr=1e30`` that must stop at their step with no bad checkpoint."""

from __future__ import annotations

import math

import pytest
import torch

from medsrl.models.char_tokenizer import build_char_tokenizer
from medsrl.models.tiny import build_tiny_model
from medsrl.rollout.base import SamplingParams
from medsrl.rollout.hf import HFRolloutEngine
from medsrl.utils.checkpoint_io import AtomicCheckpointIO
from medsrl.utils.guard import (
    RunawayError,
    RunawayGuard,
    nonfinite_tensors,
    param_norm,
    runaway_reason,
)

NAN, INF = float("nan"), float("inf")


def test_param_norm_is_the_l2_norm_over_dtypes_and_skips_empty_tensors():
    ts = [torch.tensor([3.0, 4.0]), torch.ones(2, 2, dtype=torch.bfloat16), torch.empty(0)]
    assert param_norm(ts, sharded=False) == pytest.approx((25.0 + 4.0) ** 0.5)
    assert param_norm([], sharded=False) == 0.0
    assert math.isinf(param_norm([torch.full((2,), 1e30)], sharded=False))  # overflows float32: broken
    assert math.isnan(param_norm([torch.tensor([1.0, NAN])], sharded=False))


@pytest.mark.parametrize(("norm", "start", "growth", "broken"), [
    (10.0, 10.0, 100.0, False),
    (999.0, 10.0, 100.0, False),
    (1001.0, 10.0, 100.0, True),       # grew more than 100x
    (1e33, 10.0, 0.0, False),          # growth check off: only finiteness
    (NAN, 10.0, 0.0, True),
    (INF, 10.0, 100.0, True),
    (5.0, None, 100.0, False),         # no reference yet
    (5.0, 0.0, 100.0, False),          # all-zero start: no ratio
])
def test_runaway_reason(norm, start, growth, broken):
    assert (runaway_reason(norm, start, growth) is not None) == broken


def test_the_message_names_step_cause_and_settings():
    msg = str(RunawayGuard(100.0, 10.0, 1e30, "16-mixed").error(7, runaway_reason(1e33, 10.0, 100.0)))
    assert msg.startswith("step 7: runaway update: the policy's parameter norm grew from 10 to 1e+33")
    for part in ("learning rate", "optim.optimizer.lr=1e+30", "fp16", "trainer.precision=16-mixed", "no checkpoint"):
        assert part in msg


def test_the_guard_checks_growth_from_its_start_norm_and_names_where():
    guard = RunawayGuard(max_growth=10.0, start_norm=2.0, lr=0.5, precision="16-mixed")
    guard.check([torch.full((4,), 9.0)], False, 4, "update 1/1")  # 18 <= 10 x 2
    with pytest.raises(RunawayError,
                       match=r"^step 4: .* grew from 2 to 22, .*\(update 2/2\).*trainer.precision=16-mixed"):
        guard.check([torch.full((4,), 11.0)], False, 4, "update 2/2")


def test_nonfinite_tensors_names_nan_and_inf_only():
    named = {"nan": torch.tensor([1.0, NAN]), "inf": torch.tensor([-INF], dtype=torch.bfloat16),
             "huge": torch.full((2,), 1e30), "half": torch.ones(3, dtype=torch.float16),
             "ints": torch.arange(3), "empty": torch.empty(0), "not a tensor": 3.0}
    assert nonfinite_tensors(named) == ["nan", "inf"]


def test_checkpoint_io_refuses_non_finite_weights(tmp_path):
    io = AtomicCheckpointIO()
    good, bad = tmp_path / "good.ckpt", tmp_path / "bad.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "global_step": 1}, good)
    assert torch.load(good)["global_step"] == 1
    with pytest.raises(RunawayError, match=r"refusing to write checkpoint .*bad\.ckpt.*policy\.w"):
        io.save_checkpoint({"state_dict": {"policy.w": torch.tensor([1.0, NAN])}}, bad)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good.ckpt"]  # not even a temp file


def test_nan_logits_in_sampling_raise_a_runaway_error():
    tok = build_char_tokenizer()
    model = build_tiny_model(seed=0, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                             num_key_value_heads=1, intermediate_size=16)
    engine = HFRolloutEngine(model, tok)
    params = SamplingParams(n=2, temperature=1.0, top_p=1.0, max_new_tokens=3, seed=0)
    assert len(engine.generate(["1+1="], params).response_ids) == 2
    with torch.no_grad():
        model.lm_head.weight.fill_(NAN)
    with pytest.raises(RunawayError, match="sampling probabilities are not finite.*learning rate"):
        engine.generate(["1+1="], params)


# ------------------------------------------------------------------------------ real runs


def _checkpoint_peaks(out) -> dict[str, float]:
    """{checkpoint file: largest |weight|} of every checkpoint the run left."""
    peaks = {}
    for path in sorted((out / "checkpoints").glob("*.ckpt")):
        sd = torch.load(path, weights_only=True)["state_dict"]
        peaks[path.name] = max(float(v.float().abs().max()) for v in sd.values() if v.is_floating_point())
    return peaks


@pytest.mark.slow
def test_lr_1e30_stops_at_the_first_step_and_writes_no_checkpoint(tmp_path):
    from medsrl.train import train
    from run_helpers import compose_train

    out = tmp_path / "run"
    with pytest.raises(RunawayError) as err:
        train(compose_train(out, ["optim.optimizer.lr=1e30", "trainer.max_steps=3"]))
    msg = str(err.value)
    assert msg.startswith("step 0: runaway update: the policy's parameter norm is inf"), msg
    assert "(update 1/1)" in msg and "optim.optimizer.lr=1e+30" in msg and "learning rate" in msg
    assert _checkpoint_peaks(out) == {}  # before the guard: step_000001 and last, weights ~1e30


@pytest.mark.slow
def test_a_runaway_at_step_1_keeps_step_0s_good_checkpoint(tmp_path, monkeypatch):
    """lr 1e30 x 1e-33 at step 0 (a normal update), x 1 from step 1: the run stops at step 1 and
    the checkpoints on disk are step 0's, with its ordinary weights."""
    from medsrl.module import RLModule
    from medsrl.train import train
    from run_helpers import compose_train

    configure = RLModule.configure_optimizers

    def jump_at_step_1(self):
        conf = configure(self)
        sched = torch.optim.lr_scheduler.LambdaLR(conf["optimizer"], lambda s: 1e-33 if s == 0 else 1.0)
        return {**conf, "lr_scheduler": {**conf["lr_scheduler"], "scheduler": sched}}

    monkeypatch.setattr(RLModule, "configure_optimizers", jump_at_step_1)
    out = tmp_path / "run"
    with pytest.raises(RunawayError, match=r"^step 1: runaway update: .*\(update 1/1\)"):
        train(compose_train(out, ["optim.optimizer.lr=1e30", "trainer.max_steps=3"]))
    peaks = _checkpoint_peaks(out)
    assert sorted(peaks) == ["last.ckpt", "step_000001.ckpt"], peaks
    assert all(math.isfinite(p) and p < 100 for p in peaks.values()), peaks


@pytest.mark.slow
def test_the_growth_bound_is_the_config_key(tmp_path):
    """A finite blow-up (lr 10: every weight moves by about 10) passes the non-finite check; the
    growth bound set through ``optim.max_param_norm_growth`` is what stops it."""
    from medsrl.train import train
    from run_helpers import compose_train

    with pytest.raises(RunawayError, match=r"^step 0: runaway update: .* grew from .* more than 1\.5x"):
        train(compose_train(tmp_path / "bounded", ["optim.optimizer.lr=10", "optim.max_param_norm_growth=1.5",
                                                  "optim.scheduler.warmup_steps=0", "trainer.max_steps=1"]))
