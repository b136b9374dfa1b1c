"""Whether MEDS's penalty lands on the repeated mistake. MEDS clusters features, not answers, so a
cluster can mix answers and one repeated answer can be split.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence


def cluster_answer_purity(
    group_ids: Sequence[int], labels: Sequence[int], answers: Sequence[str | None]
) -> float | None:
    """The share of labelled responses (>= 0) giving their (group, label) cluster's most common answer."""
    clusters: dict[tuple[int, int], list[str | None]] = defaultdict(list)
    for g, label, answer in zip(group_ids, labels, answers, strict=True):
        if label >= 0:
            clusters[(g, label)].append(answer)
    total = sum(len(a) for a in clusters.values())
    if not total:
        return None
    return sum(Counter(a).most_common(1)[0][1] for a in clusters.values()) / total


def penalty_on_top_answer(
    group_ids: Sequence[int], wrong: Sequence[bool], answers: Sequence[str | None], penalty: Sequence[float]
) -> tuple[float | None, float | None]:
    """``(share of the penalty on each group's most frequent wrong answer, share of the wrong
    responses giving it)``; ties: the first seen."""
    by_group: dict[int, Counter] = defaultdict(Counter)
    for g, w, a in zip(group_ids, wrong, answers, strict=True):
        if w and a is not None:
            by_group[g][a] += 1
    top = {g: c.most_common(1)[0][0] for g, c in by_group.items()}
    rows = [(a is not None and top.get(g) == a, float(p))  # (on the top answer, penalty)
            for g, w, a, p in zip(group_ids, wrong, answers, penalty, strict=True) if w]
    if not rows:
        return None, None
    pen_total = sum(p for _, p in rows)
    pen_top = sum(p for hit, p in rows if hit)
    return (pen_top / pen_total if pen_total > 0 else None), sum(hit for hit, _ in rows) / len(rows)
