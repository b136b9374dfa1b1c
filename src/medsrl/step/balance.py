"""Balanced ranks: the step's filled batch is re-dealt by whole groups so that every rank scores and
updates about as many tokens (verl's ``_balance_batch``); else DAPO's fill leaves the last round's
groups on the low ranks and the others wait in every collective. Every rank computes the same deal
from one all-gather; only moved groups travel. N ranks stay one process's run: groups keep their
place in the step's order (``Group.origin``, ``Group.index``), each update is dealt on its own,
plug-ins commit in that order (:func:`in_step_order`) and group counts stay within one."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from medsrl.utils.distributed import all_gather_objects, rank_and_size

if TYPE_CHECKING:
    from medsrl.step.rollouts import Group


def group_tokens(group: Group) -> int:
    """What a group costs: its prompt once (the shared-prompt forward) and every response token."""
    if not len(group):
        return 0
    return len(group.rollout.prompt_ids[0]) + sum(len(r) for r in group.rollout.response_ids)


def num_updates(num_groups: int, per_update: int | None) -> int:
    """The step's mini-batch updates ``U`` (``algorithm.mini_batch_prompts`` groups each; None: one)."""
    return -(-num_groups // per_update) if per_update else min(num_groups, 1)


def equal_size_partition(weights: Sequence[int], parts: int) -> list[list[int]]:
    """The indices of ``weights`` in ``parts`` sets of sizes within one and close sums:
    Karmarkar-Karp's largest differencing with equal sizes (verl's ``karmarkar_karp``), zero-weight
    fillers dropped at the end. Ties go by index, so every rank computes the same sets."""
    if parts < 1:
        raise ValueError(f"equal_size_partition: {parts} parts")
    n = len(weights)
    padded = [int(w) for w in weights] + [0] * (-n % parts)
    order = sorted(range(len(padded)), key=lambda i: (padded[i], i))
    heap: list[tuple[int, int, list[tuple[int, list[int]]]]] = []
    for c, start in enumerate(range(0, len(order), parts)):  # k items of like weight: one in each set
        heap.append(_state([(padded[i], [i]) for i in order[start:start + parts]], c))
    heapq.heapify(heap)
    made = len(heap)
    while len(heap) > 1:  # merge the two states of largest spread: heaviest sets with the lightest
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = [(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, reversed(b), strict=True)]
        heapq.heappush(heap, _state(merged, made))
        made += 1
    sets = heap[0][2] if heap else [(0, []) for _ in range(parts)]
    return [sorted(i for i in items if i < n) for _, items in sets]


def _state(sets: list[tuple[int, list[int]]], tie: int) -> tuple[int, int, list[tuple[int, list[int]]]]:
    """A heap entry of Karmarkar-Karp: the sets heaviest first, keyed by their spread (largest first)."""
    sets = sorted(sets, key=lambda s: (-s[0], s[1]))
    return -(sets[0][0] - sets[-1][0]), tie, sets


def deal(tokens: Sequence[int], holder: Sequence[int], world: int, updates: int, slack: float = 0.02) -> list[int]:
    """The rank of each of the step's groups (``holder``: where it is now), dealt per update ``k``
    (groups ``k, k + U, ...``) with counts within one: :func:`even_out` (few groups travel), unless
    Karmarkar-Karp's sets make the heaviest rank lighter by more than ``slack`` of the mean."""
    n = len(tokens)
    rank_of = list(holder)
    counts = [0] * world
    for k in range(updates):
        members = list(range(k, n, updates))
        base, extra = divmod(len(members), world)
        held = [sum(holder[i] == r for i in members) for r in range(world)]
        # one more group for the ranks with the fewest so far (counts stay within one), then those holding more
        ceil = sorted(range(world), key=lambda r: (counts[r], -held[r], r))[:extra]
        target = [base + (r in ceil) for r in range(world)]
        mine = even_out(members, tokens, holder, target)
        sets = [[members[j] for j in s] for s in equal_size_partition([tokens[i] for i in members], world)]
        kk = _hand_out(sets, tokens, holder, target)
        margin = slack * sum(tokens[i] for i in members) / world
        if max(_loads(tokens, kk, world, members)) < max(_loads(tokens, mine, world, members)) - margin:
            mine = kk
        for i in members:
            rank_of[i] = mine[i]
        for r in range(world):
            counts[r] += target[r]
    return rank_of


def even_out(members: list[int], tokens: Sequence[int], holder: Sequence[int], target: list[int]) -> dict[int, int]:
    """``members`` moved from ``holder`` to ``target`` groups per rank: a rank over its count gives
    the group that best evens it with the lightest rank under its count, then the heaviest and
    lightest ranks swap the pair that most narrows their gap while one does (so it ends)."""
    world = len(target)
    own: list[list[int]] = [[i for i in members if holder[i] == r] for r in range(world)]
    load = [sum(tokens[i] for i in own[r]) for r in range(world)]

    def move(i: int, a: int, b: int) -> None:
        own[a].remove(i)
        own[b].append(i)
        load[a] -= tokens[i]
        load[b] += tokens[i]

    while any(len(own[r]) > target[r] for r in range(world)):
        a = max((r for r in range(world) if len(own[r]) > target[r]), key=lambda r: (load[r], -r))
        b = min((r for r in range(world) if len(own[r]) < target[r]), key=lambda r: (load[r], r))
        move(min(own[a], key=lambda i: (abs(load[a] - load[b] - 2 * tokens[i]), i)), a, b)
    for _ in range(len(members) * world):
        h = max(range(world), key=lambda r: (load[r], -r))
        low = min(range(world), key=lambda r: (load[r], r))
        gap = load[h] - load[low]
        best = min(((abs(gap - 2 * (tokens[i] - tokens[j])), i, j) for i in own[h] for j in own[low]), default=None)
        if best is None or best[0] >= gap:
            break
        _, i, j = best
        move(i, h, low)
        move(j, low, h)
    return {i: r for r in range(world) for i in own[r]}


def _hand_out(sets: list[list[int]], tokens: Sequence[int], holder: Sequence[int], target: list[int]) -> dict[int, int]:
    """Each set to a rank whose target count is its size, the one holding most of its tokens first."""
    free = list(range(len(target)))
    out = {}
    for s in sorted(sets, key=lambda s: (-len(s), -sum(tokens[i] for i in s), s)):
        r = min((q for q in free if target[q] == len(s)),
                key=lambda q: (-sum(tokens[i] for i in s if holder[i] == q), q))
        free.remove(r)
        out.update({i: r for i in s})
    return out


def _loads(tokens: Sequence[int], rank_of: Any, world: int, members: Sequence[int] | None = None) -> list[int]:
    loads = [0] * world
    for i in range(len(tokens)) if members is None else members:
        loads[rank_of[i]] += tokens[i]
    return loads


def imbalance(tokens: Sequence[int], rank_of: Sequence[int], world: int) -> float:
    """Max over mean of the ranks' tokens (1: balanced; 1 with no tokens)."""
    loads = _loads(tokens, rank_of, world)
    total = sum(loads)
    return max(loads) * world / total if total else 1.0


def balance_groups(groups: list[Group], per_update: int | None,
                   gather: Callable[[Any], list[Any]] = all_gather_objects) -> tuple[list[Group], dict[str, float]]:
    """This rank's groups after the deal, in the step's order, each with its ``index``; and the
    deal's metrics."""
    rank = rank_and_size()[0]
    per_rank = gather([(g.origin, group_tokens(g)) for g in groups])
    where = [(q, j) for q, mine in enumerate(per_rank) for j in range(len(mine))]  # rank order
    if all(per_rank[q][j][0] is not None for q, j in where):  # else: rank order (groups made elsewhere)
        where.sort(key=lambda qj: per_rank[qj[0]][qj[1]][0])
    tokens = [per_rank[q][j][1] for q, j in where]
    holder = [q for q, _ in where]
    world = len(per_rank)
    rank_of = deal(tokens, holder, world, num_updates(len(tokens), per_update))
    for i, (q, j) in enumerate(where):
        if q == rank:
            groups[j].index = i
    moved = sum(r != h for r, h in zip(rank_of, holder, strict=True))
    arrived = []
    if moved:  # every rank knows whether any group moves: all call the gather or none does
        outgoing = {g.index: g for g in groups if rank_of[g.index] != rank}
        arrived = [g for sent in gather(outgoing) for i, g in sent.items() if rank_of[i] == rank]
    batch = sorted([g for g in groups if rank_of[g.index] == rank] + arrived, key=lambda g: g.index)
    metrics = {
        "rank_token_imbalance": imbalance(tokens, rank_of, world),
        "rank_token_imbalance_before": imbalance(tokens, holder, world),
        "rank_moved_groups": float(moved),
    }
    return batch, metrics


class InStepOrder(list):
    """A rank's plug-in additions with each item's place in the step's order (``keys``, None where
    unknown), so that ``commit`` applies every rank's additions as one process would."""

    def __init__(self, items=(), keys=()) -> None:
        super().__init__(items)
        self.keys = list(keys)
        if len(self.keys) != len(self):
            raise ValueError(f"InStepOrder: {len(self)} items but {len(self.keys)} keys")


def in_step_order(per_rank: list[list]) -> list:
    """Every rank's additions as one list: by their step-order keys when all have one, else in rank order."""
    keyed = all(isinstance(part, InStepOrder) and None not in part.keys for part in per_rank)
    if not keyed:
        return [item for part in per_rank for item in part]
    pairs = [(k, item) for part in per_rank for k, item in zip(part.keys, part, strict=True)]
    return [item for _, item in sorted(pairs, key=lambda p: p[0])]
