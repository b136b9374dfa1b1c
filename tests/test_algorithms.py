"""The algorithm presets: each composes into a valid module config and plug-in list, and the
methods added on the plug-in protocol (GRPO+Entropy, GDPO with MEDS) train end to end on the
micro warm-started model and log what they did."""

from __future__ import annotations

from pathlib import Path

import pytest

from medsrl.run_config import RunConfig
from medsrl.train import build_plugins, train
from run_helpers import MICRO_WARM_START, ROOT, compose_train, read_metrics

SHORT = ["trainer.max_steps=2", "callbacks.pass_at_k.every_n_steps=0", "callbacks.pass_at_k.at_start=false"]
PRESETS = sorted(p.stem for p in (ROOT / "configs" / "algorithm").glob("[!_]*.yaml"))  # _defaults: the schema
EXPECTED_PLUGINS = {
    "grpo": [], "drgrpo": [], "grpo_entropy": ["entropy_bonus"],
    "dapo": ["dynamic_sampling", "overlong"], "gdpo": ["dynamic_sampling", "overlong"],
    "clip_cov": ["dynamic_sampling", "overlong"], "kl_cov": ["dynamic_sampling", "overlong"],
    "steer": ["dynamic_sampling", "overlong", "steer"],
    "novelty": ["dynamic_sampling", "overlong", "novelty"], "lp_reg": [],
    "meds": ["dynamic_sampling", "overlong", "meds"],
    "r3": ["r3"], "meds_r3": ["r3", "dynamic_sampling", "overlong", "meds"],  # R3 before DAPO's filter
    "w_reinforce": [], "passk": ["dynamic_sampling", "overlong"],
    "outcome_ucb": ["dynamic_sampling", "overlong", "outcome_ucb"],
}
# issue 45's presets, each with the preset it extends: it composes with every experiment that does
NEW_PRESETS = {"w_reinforce": "grpo", "passk": "dapo", "outcome_ucb": "dapo"}
EXPERIMENTS = sorted(p.stem for p in (ROOT / "configs" / "experiment").glob("[!_]*.yaml"))


@pytest.mark.parametrize("name", PRESETS)
def test_preset_composes_into_settings_and_plugins_in_order(tmp_path, name):
    cfg = compose_train(tmp_path, [f"algorithm={name}"], debug=None)
    run = RunConfig.parse(cfg)  # valid names and values
    plugins = build_plugins(run.algorithm.plugins)
    assert [p.name for p in plugins] == EXPECTED_PLUGINS[name]


def _parses(tmp_path, overrides: list[str]) -> bool:
    try:
        RunConfig.parse(compose_train(tmp_path, overrides, debug=None))
    except ValueError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(NEW_PRESETS))
def test_new_preset_composes_with_every_experiment_its_base_composes_with(tmp_path, name):
    """The GPU experiments included: `experiment=<e> algorithm=<name>` parses wherever
    `algorithm=<base>` does (tiny_grpo's 64-token responses refuse DAPO's overlong buffer)."""
    base = NEW_PRESETS[name]
    composing = [e for e in EXPERIMENTS if _parses(tmp_path, [f"experiment={e}", f"algorithm={base}"])]
    assert len(composing) >= len(EXPERIMENTS) - 1 and "qwen3-8b_meds" in composing
    for e in composing:
        run = RunConfig.parse(compose_train(tmp_path, [f"experiment={e}", f"algorithm={name}"], debug=None))
        assert run.algorithm.name == name and run.algorithm.advantage == (
            name if name != "outcome_ucb" else "grpo"), e


@pytest.fixture(scope="module")
def runs(tmp_path_factory, micro_cache) -> dict[str, dict[int, dict[str, float]]]:
    root = Path(tmp_path_factory.mktemp("algorithms"))
    cases = {
        "grpo": ["algorithm=grpo"],
        "grpo_entropy": ["algorithm=grpo_entropy"],
        "meds_gdpo": ["algorithm=meds", "algorithm.advantage=gdpo", "algorithm.plugins.dynamic_sampling=null",
                      "algorithm.plugins.meds.mixed_groups_only=false"],
        # a share large enough that the 2-step micro run selects more than the one-token minimum
        "clip_cov": ["algorithm=clip_cov", "algorithm.policy_loss_options.clip_cov_ratio=0.05",
                     "algorithm.policy_loss_options.clip_cov_lb=0.0"],
        "kl_cov": ["algorithm=kl_cov", "algorithm.policy_loss_options.kl_cov_ratio=0.05"],
        "steer": ["algorithm=steer"],
        "novelty": ["algorithm=novelty"],
        "novelty_hidden": ["algorithm=novelty", "algorithm.plugins.novelty.vectors=hidden_mean"],
        "lp_reg": ["algorithm=lp_reg", "algorithm.policy_loss_options.bottom_frac=0.2"],
        "w_reinforce": ["algorithm=w_reinforce"],
        "passk": ["algorithm=passk", "algorithm.advantage_options.k=2"],  # k < rollout.n (4): a signal
        "outcome_ucb": ["algorithm=outcome_ucb"],
        "meds_shuffled": ["algorithm=meds", "algorithm.plugins.meds.shuffle_penalties=true"],
    }
    out = {}
    for name, overrides in cases.items():
        summary = train(compose_train(root / name, MICRO_WARM_START + SHORT + overrides, cache_dir=micro_cache))
        assert summary["steps"] == 2
        out[name] = read_metrics(root / name)
    return out


@pytest.mark.slow
def test_grpo_entropy_logs_its_bonus_and_changes_the_update(runs):
    """Same seed and the same first update (no group has a spread at step 0, so both advantages
    are 0 there), hence the same samples at step 1, where the bonus must move the policy loss."""
    plain, bonus = runs["grpo"][1], runs["grpo_entropy"][1]
    assert bonus["train/entropy_bonus/bonus_mean"] > 0
    assert 0 <= bonus["train/entropy_bonus/capped_frac"] <= 1
    assert plain["train/acc"] == bonus["train/acc"]
    assert plain["train/pg_loss"] != bonus["train/pg_loss"]


@pytest.mark.slow
def test_meds_with_gdpo_trains(runs):
    m = runs["meds_gdpo"]
    assert m[1]["train/meds/memory_entries"] > 0
    assert all(m[s]["train/nonfinite_updates"] == 0.0 for s in (0, 1))


@pytest.mark.slow
def test_covariance_losses_train_and_log_what_they_did(runs):
    """Step 1 (the first with a group that has spread, so non-zero advantages)."""
    clip, kl = runs["clip_cov"][1], runs["kl_cov"][1]
    assert 0 < clip["train/clip_cov/cov_clipped_frac"] <= clip["train/clip_cov/cov_candidate_frac"]
    assert 0 < kl["train/kl_cov/kl_penalised_frac"] < 0.2 and kl["train/kl_cov/abs_kl"] >= 0
    assert kl["train/clipfrac"] == 0  # kl_cov does not clip


@pytest.mark.slow
def test_steer_weights_span_their_range(runs):
    m = runs["steer"][1]
    assert m["train/steer/weight_min"] == pytest.approx(0.8) and m["train/steer/weight_max"] == pytest.approx(1.2)
    assert 0.8 < m["train/steer/weight_mean"] < 1.2


@pytest.mark.slow
def test_novelty_rewards_stay_in_their_ranges(runs):
    for name, rate in (("novelty", None), ("novelty_hidden", 1.0)):
        m = runs[name][1]
        assert -1.0 <= m["train/novelty/wrong_mean"] <= -0.5, name
        assert m["train/novelty/right_mean"] == 0 or 0.5 <= m["train/novelty/right_mean"] <= 1.0, name
        assert m["train/novelty/vector_rate"] > 0.5 if rate is None else m["train/novelty/vector_rate"] == rate


@pytest.mark.slow
def test_lp_reg_regularises_low_probability_negative_tokens(runs):
    m = max(runs["lp_reg"].values(), key=lambda s: s["train/lp_reg/candidate_frac"])
    assert 0 < m["train/lp_reg/reg_frac"] <= m["train/lp_reg/candidate_frac"] < 0.2
    assert m["train/lp_reg/reg_kl"] > 0 and 0 < m["train/lp_reg/proxy_support_frac"] <= 1
    assert m["train/nonfinite_updates"] == 0


@pytest.mark.slow
def test_issue_45_methods_train_and_log_what_they_did(runs):
    for name in ("w_reinforce", "passk", "outcome_ucb", "meds_shuffled"):
        assert all(m["train/nonfinite_updates"] == 0.0 for m in runs[name].values()), name
    ucb = runs["outcome_ucb"]
    assert 0 < ucb[0]["train/outcome_ucb/bonus_mean"] <= 0.5  # c = 0.5 at most, for an answer never seen
    assert ucb[1]["train/outcome_ucb/answers_known"] >= ucb[0]["train/outcome_ucb/answers_known"] > 0
    assert runs["meds_shuffled"][1]["train/meds/memory_entries"] > 0  # MEDS's memory fills as ever
