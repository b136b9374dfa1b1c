"""Protocol v3's one command: the parts' commands, D1's rule for D2's memory, the report's figures."""

import pytest

from medsrl.study import report_v3, v3
from medsrl.study.runner import StudySettings, split_overrides


def test_d3_arms_are_distinct_runs_of_known_methods(tmp_path):
    StudySettings(methods=v3.D3_METHODS).check()
    cmd = v3.d3_command(tmp_path, [0, 1, 2])
    options, overrides = split_overrides(cmd[3:])
    assert "--no-eval" in options and ["--steps-b", "0"] == options[options.index("--steps-b"):][:2]
    assert overrides == v3.SAMPLES  # every trained-on response logged: the route analyses


def test_d2_gives_the_third_arm_the_chosen_memory_at_a_stronger_alpha(tmp_path):
    cmd = v3.d2_command(tmp_path, [0], ["mode=answer"])
    assert "meds@mode=answer,alpha=0.5,beta=1.0" in cmd and "rollout.n=16" in cmd
    assert "--eval-override=+benchmark.study_l1.trap_fraction=0.75" in cmd
    options, overrides = split_overrides(cmd[3:])
    assert "+model.warm_start.task_options.wrong_routes=[shortcut,add,drop]" in overrides
    assert not any(o.startswith("+benchmark") for o in overrides)  # they stay with their option


def _audit(*rows):
    return {"variants": [dict(zip(("feature", "store", "G3", "G4"), r, strict=True)) for r in rows]}


def test_d1_rule_takes_the_best_feature_memory_or_else_the_answer_keyed_one():
    choose = report_v3.chosen_memory
    assert (choose(_audit(("reference", "reference", 0.01, 0.05), ("-", "answer", 0.3, 1.0)))
            == ("answer", ["mode=answer"]))
    rows = [("reference", "reference", 0.02, 0.35), ("diff", "dedup", 0.05, 0.5), ("bf16", "reference", -0.1, 0.8)]
    assert choose(_audit(*rows)) == ("diff feature, dedup store", ["diff=true", "dedup=true"])
    with pytest.raises(SystemExit, match="not a MEDS plug-in setting"):
        choose(_audit(("two_tokens", "reference", 0.1, 0.6)))


def test_the_gate_needs_every_figure_past_its_threshold():
    ok = {"g1": [0.3, 0.4], "g2": [0.02], "g3": [0.01], "g4": [0.25]}
    assert report_v3.gate_met(ok) is True
    assert report_v3.gate_met({**ok, "g3": [0.0]}) is False
    assert report_v3.gate_met({**ok, "g4": []}) is None


def test_visits_until_a_hard_trap_is_first_answered_right():
    trap, easy = "Compute 3 + 4 * 2.", "Compute 3 * 4 + 2."

    def rows(key, problem, visits):
        return [{"key": key, "problem": problem, "step": s, "reward": float(r)}
                for s, rewards in enumerate(visits) for r in rewards]

    data = (rows("t1", trap, [[0, 0], [0, 0], [1, 0]])  # hard: right at its 2nd later visit
            + rows("t2", trap, [[0, 0], [0, 0]])  # hard, never right: 1 later visit + 1
            + rows("t3", trap, [[1, 0], [0, 0]])  # not hard
            + rows("e", easy, [[0, 0], [1, 1]]))  # not a trap
    assert report_v3.visits_to_first_right(data) == (2.0, 2)


def test_route_diversity_counts_routes_per_prompt_within_a_step_and_over_the_run():
    right, short = "4 * 2 = 8. 3 + 8 = 11. \\boxed{11}", "3 + 4 = 7. 7 * 2 = 14. \\boxed{14}"
    rows = [{"key": "a", "problem": "Compute 3 + 4 * 2.", "step": s, "response": t}
            for s, t in ((0, right), (0, right), (1, short), (1, right))]
    # step 0: one route; step 1: two; over the run: two
    assert report_v3.route_diversity_of(rows) == (1.5, 2.0)


def test_the_gate_table_reads_each_arm_from_its_curves(tmp_path):
    import numpy as np

    from medsrl.study.collect import Method, RunData, Study

    steps = np.arange(3)

    def curves(g1, g2, g3, g4):
        tags = [t for t, _, _ in report_v3.GATE]
        return {tag: (steps, np.full(3, v, dtype=float)) for tag, v in zip(tags, (g1, g2, g3, g4), strict=True)}

    runs = {("dapo", s): RunData("dapo", s) for s in (0, 1)}
    runs |= {("meds", s): RunData("meds", s, curves=curves(0.5, 0.02 + s / 100, 0.01, 0.4)) for s in (0, 1)}
    runs |= {("weak", s): RunData("weak", s, curves=curves(0.5, 0.02, -0.01, 0.0)) for s in (0, 1)}
    study = Study(tmp_path, {}, "x", [Method("dapo", "DAPO"), Method("meds", "MEDS"), Method("weak", "Weak")],
                  [0, 1], 3, 0, "dapo", "meds", runs, [], [])
    rows = report_v3.gate_table(study)
    assert rows[2].startswith("| DAPO | - |") and rows[2].endswith("| - |")
    assert "| 2.5 ± 0.7 |" in rows[3] and rows[3].endswith("| yes |")  # G2 in % over the two seeds
    assert rows[4].endswith("| no |")  # G3 < 0: the penalty does not target the repeated mistake


def test_d2s_memory_is_chosen_once_and_kept(tmp_path):
    import json

    (tmp_path / "v3_d1" / "audit").mkdir(parents=True)
    audit = tmp_path / "v3_d1" / "audit" / "audit.json"
    audit.write_text(json.dumps(_audit(("diff", "dedup", 0.05, 0.5))))
    assert report_v3.d2_memory(tmp_path) == ("diff feature, dedup store", ["diff=true", "dedup=true"])
    audit.write_text(json.dumps(_audit(("bf16", "reference", 0.05, 0.9))))  # a later audit
    assert report_v3.d2_memory(tmp_path)[0] == "diff feature, dedup store"
