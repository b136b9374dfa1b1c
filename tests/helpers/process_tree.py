"""The processes below a pid, for the tests that check a dead owner leaves no worker behind."""

from __future__ import annotations

from pathlib import Path

from medsrl.utils.lifetime import ProcessRef, _has_proc, _proc_stat


def descendants(pid: int) -> list[ProcessRef]:
    """Every running process below ``pid`` (Linux /proc; empty elsewhere)."""
    children: dict[int, list[ProcessRef]] = {}
    for entry in Path("/proc").glob("[0-9]*") if _has_proc() else []:
        stat = _proc_stat(int(entry.name))
        if stat is not None and stat[1] not in "ZXx":
            children.setdefault(stat[0], []).append(ProcessRef(int(entry.name), stat[2]))
    out, frontier = [], [pid]
    while frontier:
        found = children.get(frontier.pop(), [])
        out += found
        frontier += [child.pid for child in found]
    return out
