"""Protocol v4's report on hand-made studies: the hard subset chosen from the warm start, every arm
against DAPO on paired seeds (paired t, within-seed sign flips, detectable effect, TOST), the
validity rule of the positive controls and the pre-registered readings; gate v2's columns.

The synthetic study: 24 test problems of n = 16 samples, 8 seeds, arms built from one count of
right answers per (seed, problem) that every arm shares (the paired design), plus each arm's own
change: W-REINFORCE +3 or +4 right answers on every hard problem (shown higher); Pass@k +2 on
even seeds and -1 on odd ones (noise: not detected); MEDS one right answer more or less on one
problem per seed, alternately (equivalent), with four kinds of wrong answers instead of two
(shown higher on the rarefied distinct wrong answers).
"""

import json
import math

import numpy as np
import pytest
from scipy.stats import ttest_1samp, ttest_rel
from studies import stats
from studies.collect import Method, RunData, Study, load_study
from studies.report import (
    GATE,
    GATE_V2,
    Outcome,
    PairedDesign,
    gate_table,
    hard_subset,
    problem_outcome,
    write_report,
)
from studies.runner import load_protocol, method_dir

from medsrl.evaluation.diversity import rarefied_distinct_wrong
from medsrl.evaluation.passk import pass_at_k
from medsrl.evaluation.tables import summarize_benchmark, write_json

N, BENCH, SEEDS, ROUNDS = 16, "study_l1", list(range(8)), 1000
# the warm start's right answers of 16 per problem: 0-13 have pass@8 0.5 or 0.77 (the hard
# subset of [0.2, 0.8]); the others 0 or >= 0.96
WARM = [1, 2] * 7 + [0, 0, 5, 8, 9, 12, 16, 16, 10, 6]
HARD = set(range(14))
MEDS = "meds@algorithm.plugins.meds.clustering.mode=answer,alpha=0.5,beta=1.0"


def shared(s, p):
    """The right answers every arm of seed s has on problem p (the seeds' shared variation)."""
    return WARM[p] + ((s + p) % 4 == 0)


def strong(s, p):  # W-REINFORCE: more right answers on every hard problem, every seed
    return 3 + s % 2 if p in HARD else 0


def noisy(s, p):  # Pass@k: +2 on even seeds, -1 on odd ones
    return (2 if s % 2 == 0 else -1) if p in HARD else 0


def alternate(s, p):  # MEDS: one answer more on problem 0 (even seeds), one less on problem 1 (odd)
    return 1 if (s % 2, p) == (0, 0) else -1 if (s % 2, p) == (1, 1) else 0


def none(s, p):
    return 0


# name: (label, change of right answers, kinds of wrong answers)
ARMS = {
    "dapo": ("DAPO", none, 2),
    "w_reinforce": ("W-REINFORCE", strong, 2),
    "passk": ("Pass@k advantage", noisy, 2),
    MEDS: ("MEDS (mode answer, alpha 0.5, cap 1.0)", alternate, 4),
}


def right(arm, s, p):
    return min(N, max(0, shared(s, p) + ARMS[arm][1](s, p)))


def samples(c, kinds):
    """(answers, scores): c right answers ("7"), the rest wrong, cycling through ``kinds`` answers."""
    return ["7"] * c + [str(100 + j % kinds) for j in range(N - c)], [1.0] * c + [0.0] * (N - c)


def write_eval(out, run, problems):
    """A medsrl-eval directory: results.json and generations.jsonl of ``problems`` [(answers, scores)]."""
    out.mkdir(parents=True)
    write_json([summarize_benchmark(run, BENCH, [a for a, _ in problems], [s for _, s in problems])],
               out / "results.json")
    lines = [json.dumps({"run": run, "benchmark": BENCH, "index": i, "problem": "?", "gold": "7",
                         "responses": [{"text": f"\\boxed{{{a}}}", "extracted": a, "score": s}
                                       for a, s in zip(answers, scores, strict=True)]})
             for i, (answers, scores) in enumerate(problems)]
    (out / "generations.jsonl").write_text("\n".join(lines) + "\n")


def build_v4_study(root, arms=ARMS, *, skip=()):
    """The study root (study.json, eval/<arm>/seed<k>, eval/warm_start/seed0); ``skip``: the
    (arm, seed) evaluations left out."""
    root.mkdir(parents=True)
    (root / "study.json").write_text(json.dumps({
        "name": "v4", "methods": [{"name": method_dir(a), "label": arms[a][0]} for a in arms],
        "seeds": SEEDS, "steps_a": 12, "steps_b": 0, "eval_n": N, "baseline": "dapo", "commit": "abc1234"}))
    write_eval(root / "eval" / "warm_start" / "seed0", "warm", [samples(c, 2) for c in WARM])
    for arm, (_, change, kinds) in arms.items():
        for s in SEEDS:
            if (arm, s) not in skip:
                problems = [samples(min(N, max(0, shared(s, p) + change(s, p))), kinds) for p in range(len(WARM))]
                write_eval(root / "eval" / method_dir(arm) / f"seed{s}", f"{arm}-{s}", problems)
    return root


def v4_part():
    (part,) = load_protocol("v4")["parts"]
    return part


def design_of(root, part=None):
    spec = {k: v for item in (part or v4_part())["report"] if isinstance(item, dict) for k, v in item.items()}
    return PairedDesign(load_study(root), spec, ROUNDS)


@pytest.fixture(scope="module")
def study_root(tmp_path_factory):
    return build_v4_study(tmp_path_factory.mktemp("v4") / "v4")


def seed_means(arm, key, problems):
    """An arm's outcome per seed, computed here from the construction."""
    def value(c, kinds):
        answers, scores = samples(c, kinds)
        if key == "hard_pass@8":
            return pass_at_k(N, c, 8)
        return rarefied_distinct_wrong(answers, scores, 4)

    out = []
    for s in SEEDS:
        vals = [value(right(arm, s, p), ARMS[arm][2]) for p in problems]
        out.append(float(np.nanmean(vals)))
    return out


def test_the_hard_subset_is_the_warm_starts_problems_in_the_interval(study_root):
    d = design_of(study_root)
    assert d.hard.problems == {(BENCH, p) for p in HARD}
    assert d.hard.interval == (0.2, 0.8) and not d.hard.widened and d.hard.candidates == 24
    assert d.hard.warm_value == pytest.approx((pass_at_k(N, 1, 8) + pass_at_k(N, 2, 8)) / 2)
    # a trained policy's pass@8 plays no part: DAPO has problem 14 (warm start 0 right) at 0.5 on seeds 2, 6
    assert problem_outcome(load_study(study_root).runs[("dapo", 2)].problems[(BENCH, 14)], "pass@8") == 0.5


def test_too_few_hard_problems_widen_the_interval_as_the_protocol_says(study_root):
    warm = load_study(study_root).warm_start
    # pass@4 of n = 16: 1 right 0.25, 2 right 0.45, 5 right 0.82, 6 right 0.89, 8 right 0.96
    hs = hard_subset(warm, k=4, low=0.2, high=0.8, min_problems=15, wider=[0.1, 0.9])
    assert hs.widened and hs.interval == (0.1, 0.9)
    assert hs.problems == {(BENCH, p) for p in (*HARD, 16, 23)}  # 5 and 6 right answers join
    assert hard_subset(warm, k=4, low=0.2, high=0.8, min_problems=14, wider=[0.1, 0.9]).problems == {
        (BENCH, p) for p in HARD}


def test_a_positive_control_is_shown_higher_with_both_tests(study_root):
    d = design_of(study_root)
    r = d.reading("dapo", "w_reinforce", "hard_pass@8")
    a, b = seed_means("dapo", "hard_pass@8", HARD), seed_means("w_reinforce", "hard_pass@8", HARD)
    assert list(r.a_seeds) == pytest.approx(a) and list(r.b_seeds) == pytest.approx(b)
    assert r.paired.diff == pytest.approx(np.mean(np.subtract(b, a)))
    assert r.paired.p == pytest.approx(ttest_rel(b, a).pvalue) and r.paired.p < 0.05
    # every (seed, hard problem) pair is higher: the sign flips find it too
    assert r.pairs == 8 * 14 and r.flip_diff > 0 and r.flip_p < 0.05
    xs = [pass_at_k(N, right("dapo", s, p), 8) for s in SEEDS for p in sorted(HARD)]
    ys = [pass_at_k(N, right("w_reinforce", s, p), 8) for s in SEEDS for p in sorted(HARD)]
    assert r.flip_p == pytest.approx(stats.within_seed_sign_flip(xs, ys, rounds=ROUNDS))
    assert r.verdict == "shown higher" and r.direction == 1


def test_a_small_alternating_change_is_equivalent_within_the_margin(study_root):
    d = design_of(study_root)
    r = d.reading("dapo", method_dir(MEDS), "hard_pass@8")
    diffs = np.subtract(seed_means(MEDS, "hard_pass@8", HARD), seed_means("dapo", "hard_pass@8", HARD))
    assert r.paired.diff == pytest.approx(0.0, abs=1e-12) and r.paired.p > 0.5
    tost = max(ttest_1samp(diffs, -0.05, alternative="greater").pvalue,
               ttest_1samp(diffs, 0.05, alternative="less").pvalue)
    assert r.paired.p_equivalent == pytest.approx(tost) and tost < 0.05
    assert r.verdict == "equivalent within ±5.0 pp"
    # four kinds of wrong answers instead of two: more distinct wrong answers among 4, everywhere
    w = d.reading("dapo", method_dir(MEDS), "rarefied_wrong@4")
    problems = range(len(WARM))
    expected = np.subtract(seed_means(MEDS, "rarefied", problems), seed_means("dapo", "rarefied", problems))
    assert w.paired.diff == pytest.approx(expected.mean()) and w.verdict.startswith("shown higher")


def test_noise_is_not_detected_and_says_what_could_have_been(study_root):
    r = design_of(study_root).reading("dapo", "passk", "hard_pass@8")
    diffs = np.subtract(seed_means("passk", "hard_pass@8", HARD), seed_means("dapo", "hard_pass@8", HARD))
    assert r.paired.p == pytest.approx(ttest_rel(diffs, np.zeros(8)).pvalue) and r.paired.p > 0.05
    detectable = stats.detectable_effect(float(np.std(diffs, ddof=1)), 8)
    assert r.paired.detectable == pytest.approx(detectable)
    assert not r.paired.equivalent and r.verdict == f"not detected (detectable: {100 * detectable:.1f} pp)"
    # no margin: no TOST
    assert math.isnan(design_of(study_root).reading("dapo", "passk", "hill2_wrong").paired.p_equivalent)


def _line(md, start):
    return next(line for line in md.splitlines() if line.startswith(start))


def test_the_v4_report_is_sensitive_and_draws_every_verdict(study_root, tmp_path):
    md = write_report(study_root.parent, None, tmp_path / "img", [v4_part()], rounds=ROUNDS)
    assert "**Hard subset**: the 14 of 24 test problems whose warm-start pass@8 (unbiased, from n = 16" in md
    assert "Problems: `study_l1` 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13." in md
    assert "**The assay is sensitive**: W-REINFORCE: hard-subset pass@8 (%) shown higher" in md
    hard_table = md.split("#### hard-subset pass@8 (%) (TOST margin ±5.0 pp)")[1].split("####")[0]
    assert _line(hard_table, "| DAPO (baseline) | ").endswith("| 8 | - | - | - | - | - | - |")
    assert _line(hard_table, "| W-REINFORCE | ").endswith("| shown higher |")
    detectable = design_of(study_root).reading("dapo", "passk", "hard_pass@8").paired.detectable
    expected = f"| not detected (detectable: {100 * detectable:.1f} pp) |"
    assert _line(hard_table, "| Pass@k advantage | ").endswith(expected)
    assert _line(hard_table, "| MEDS (mode answer, alpha 0.5, cap 1.0) | ").endswith("| equivalent within ±5.0 pp |")
    assert "#### Cover@0.5 (%) (no equivalence margin)" in md
    # reading 3: the MEDS arm minus Pass@k; the arms the study lacks have no seeds
    reading = md.split("#### Reading 3: MEDS (mode answer, alpha 0.5, cap 1.0) vs Pass@k advantage")[1].split("####")[0]
    assert _line(reading, "| hard-subset pass@8 (%) | ").count("| 8 |") == 1
    assert "| too few paired seeds (0) |" in md.split("#### Reading 4")[1]
    assert "#### Reading 1: MEDS (mode answer, alpha 0.5, cap 1.0) vs MEDS (mode answer, alpha 0.5, cap 1.0, " \
           "shuffle_penalties true)" in md  # an arm the study lacks: the runner's label
    assert "paired p < 0.001" in md
    assert "no verdict" not in md


def test_an_insensitive_assay_draws_no_verdict_on_the_other_arms(tmp_path):
    arms = {**ARMS, "w_reinforce": ("W-REINFORCE", none, 2)}  # the control does nothing
    root = build_v4_study(tmp_path / "v4", arms)
    d = design_of(root)
    assert d.validity.sensitive is False and not d.validity.shown
    md = write_report(tmp_path, None, tmp_path / "img", [v4_part()], rounds=ROUNDS)
    assert "**The assay is insensitive**" in md and "**no verdict on MEDS is drawn**" in md
    hard_table = md.split("#### hard-subset pass@8 (%)")[1].split("####")[0]
    assert _line(hard_table, "| W-REINFORCE | ").endswith("| equivalent within ±5.0 pp |")  # a control: a verdict
    assert _line(hard_table, "| MEDS (mode answer, alpha 0.5, cap 1.0) | ").endswith(
        "| no verdict (validity rule) |")
    reading = md.split("#### Reading 1:")[1].split("####")[0]
    assert all(line.endswith("| no verdict (validity rule) |") for line in reading.splitlines() if line.startswith("| ")
               and not line.startswith(("| outcome", "|---")))


def test_a_control_without_every_seed_leaves_the_rule_undecided(tmp_path):
    root = build_v4_study(tmp_path / "v4", skip={("passk", 7)})
    d = design_of(root)
    assert d.validity.sensitive is None and d.validity.lacking == ("passk",)
    assert not d.verdicts_drawn(method_dir(MEDS)) and d.verdicts_drawn("w_reinforce")
    md = write_report(tmp_path, None, tmp_path / "img", [v4_part()], rounds=ROUNDS)
    assert "**Not decided yet**: Pass@k advantage lack evaluated seeds (of 8)" in md
    # the paired table pairs the seven seeds Pass@k has
    assert _line(md.split("#### hard-subset pass@8")[1], "| Pass@k advantage | ").split("|")[3].strip() == "7"


def test_without_a_warm_start_evaluation_there_is_no_hard_subset(tmp_path):
    root = build_v4_study(tmp_path / "v4")
    (root / "eval" / "warm_start" / "seed0" / "results.json").unlink()
    d = design_of(root)
    assert d.hard is None and d.validity.sensitive is None and "warm_start" in d.validity.lacking
    md = write_report(tmp_path, None, tmp_path / "img", [v4_part()], rounds=ROUNDS)
    assert "No hard subset yet: the warm start's evaluation" in md


def test_outcomes_of_a_problem():
    answers, scores = samples(3, 4)  # 3 right, 13 wrong over 4 answers
    assert problem_outcome_of(answers, scores, "pass@1") == pytest.approx(3 / 16)
    assert problem_outcome_of(answers, scores, "hard_pass@8") == pytest.approx(pass_at_k(16, 3, 8))
    assert problem_outcome_of(answers, scores, "cover@0.5") == 0.0
    assert problem_outcome_of(*samples(8, 2), "cover@0.5") == 1.0
    assert math.isnan(problem_outcome_of(*samples(13, 2), "rarefied_wrong@4"))  # 3 wrong < 4
    hill2 = 1 / sum((c / 13) ** 2 for c in (4, 3, 3, 3))  # the 13 wrong answers: 4, 3, 3, 3 of each kind
    assert problem_outcome_of(answers, scores, "hill2_wrong") == pytest.approx(hill2)
    with pytest.raises(ValueError, match="no outcome"):
        problem_outcome_of(answers, scores, "mean@8")
    assert Outcome.parse(["pass@1", "pass@1 (%)", 100.0, None]).margin != Outcome.parse(["x", "x"]).margin  # nan


def problem_outcome_of(answers, scores, key):
    from studies.collect import ProblemSamples

    return problem_outcome(ProblemSamples(scores, answers), key)


def _gate_study(tmp_path, tags):
    steps = np.arange(3)
    runs = {("dapo", s): RunData("dapo", s) for s in (0, 1)}
    runs |= {("meds", s): RunData("meds", s, curves={t: (steps, np.full(3, 0.1 * (i + 1) + 0.01 * s))
                                                    for i, t in enumerate(tags)}) for s in (0, 1)}
    return Study(tmp_path, {}, "x", [Method("dapo", "DAPO"), Method("meds", "MEDS")], [0, 1], 3, 0, "dapo",
                 "meds", runs, [], [])


def test_gate_v2_shows_what_a_root_logged_and_a_v3_root_reads_as_before(tmp_path):
    v3 = gate_table(_gate_study(tmp_path, [t for t, _, _ in GATE]))
    assert v3[0] == ("| arm | G1 groups with >= 2 distinct wrong penalties (%) | G2 advantage rewritten by MEDS (%) | "
                     "G3 penalty on the top wrong answer minus its share (pp) | G4 size vs earlier count, Spearman "
                     "| gate met |")
    v2_tags = [t for t, _, _ in GATE_V2 if t != GATE[2][0]]  # v4's roots: the per-group G3 only
    assert {t.rsplit("/", 1)[1] for t in v2_tags} == {
        "g1_distinct_penalty_groups", "g2_advantage_rewritten", "g2_common", "g2_targeted",
        "g3_group_top_answer_excess", "g4_size_recurrence_corr", "g5_rewarded_errors", "g6_correct_advantage_loss"}
    rows = gate_table(_gate_study(tmp_path, v2_tags), [("train/acc", "training accuracy (%)", 100.0)])
    assert rows[0].count("|") == 1 + 1 + 8 + 1 and "gate met" not in rows[0]  # no v4 threshold
    assert "G3 within each group" in rows[0] and "G2 targeted part" in rows[0]
    assert rows[2] == "| DAPO | - | - | - | - | - | - | - | - | - |"
    assert rows[3].startswith("| MEDS | 10.5 ± 0.7 | 20.5 ± 0.7 |")
    # no gate figure logged at all: v3's columns (all '-'), as before
    assert gate_table(_gate_study(tmp_path, []))[0] == v3[0]


def test_the_plugin_logs_the_gate_figures_the_report_reads():
    from pathlib import Path

    import studies

    source = (Path(studies.__file__).parents[1] / "src" / "medsrl" / "methods" / "meds" / "plugin.py").read_text()
    for tag, _, _ in GATE_V2:
        if tag != GATE[2][0]:  # v3's pooled G3, read from finished v3 roots only
            assert f'"{tag.rsplit("/", 1)[1]}"' in source, tag
