"""An evaluation's generations file: a JSON line per problem of a (run, benchmark), with the settings'
fingerprint, appended as graded. Reopened, it resumes: a torn last line is dropped, other settings refused."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def settings_fingerprint(settings: dict[str, Any]) -> str:
    """A short, stable hash of the settings that decide what is generated."""
    blob = json.dumps(settings, sort_keys=True, default=str)
    return hashlib.sha1(blob.encode("utf-8")).hexdigest()[:12]


class GenerationStore:
    """Append-only per-problem records keyed by ``(run, benchmark, index)``."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.records: dict[tuple[str, str, int], dict[str, Any]] = {}
        self.dropped_lines = 0
        self._load()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())

    def _load(self) -> None:
        if not self.path.exists():
            return
        raw = self.path.read_bytes()
        good_end = 0
        for lineno, line in enumerate(raw.split(b"\n"), start=1):
            end = good_end + len(line) + 1
            if line.strip():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    if end >= len(raw):  # only the last line can be cut off by a kill
                        self.dropped_lines = 1
                        log.warning("%s: dropped the incomplete last line of an interrupted run", self.path)
                        break
                    raise ValueError(f"{self.path}:{lineno}: not valid JSON; the generations file is damaged") from None
                self.records[(rec["run"], rec["benchmark"], int(rec["index"]))] = rec
            good_end = min(end, len(raw))
        if good_end < len(raw):
            os.truncate(self.path, good_end)  # drop the torn tail: new lines start on a clean line

    def lookup(self, run: str, benchmark: str, index: int, fingerprint: str | None) -> dict[str, Any] | None:
        """The stored record of a problem or ``None``; ``ValueError`` when made with other settings."""
        rec = self.records.get((run, benchmark, index))
        if rec is not None and rec.get("settings") != fingerprint:
            raise ValueError(
                f"{self.path}: problem {index} of {benchmark!r} for run {run!r} was generated with "
                f"other settings or another model ({rec.get('settings')} != {fingerprint}); "
                "evaluate into a new output directory or delete the file"
            )
        return rec

    def add(self, record: dict[str, Any], fingerprint: str | None) -> None:
        record = {**record, "settings": fingerprint}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        self.records[(record["run"], record["benchmark"], int(record["index"]))] = record

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> GenerationStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
