"""``medsrl-data`` (``make data``): fetch the benchmark and training files a clone lacks.

Each file of :data:`medsrl.data.sources.MANIFEST` comes from its public source at its recorded
commit (or ``--base``) and must have its recorded sha256: it goes to a temp file beside its place,
renamed only then, so a failed or interrupted fetch leaves nothing. Only the standard library fetches.
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import os
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from omegaconf import OmegaConf

from medsrl.data.sources import MANIFEST, DataFile, data_dir_default

__all__ = ["DEFAULT_BASE", "FetchError", "default_root", "main", "select", "url_for"]

ROOT = Path(__file__).resolve().parents[3]  # the repository (an editable install)
PATHS_CONFIG = ROOT / "configs" / "paths" / "default.yaml"
DEFAULT_BASE = "https://raw.githubusercontent.com/{repo}/{commit}/{path}"
CHUNK = 1 << 20
TIMEOUT_S = 60


class FetchError(RuntimeError):
    """A file could not be fetched or has the wrong sum; the message names it."""


STATUSES = ("fetched", "already there", "ok", "FAILED")


@dataclass(frozen=True)
class Outcome:
    local: str
    status: str  # fetched | already there | ok | FAILED
    detail: str = ""

    @property
    def failed(self) -> bool:
        return self.status == "FAILED"


def default_root() -> Path:
    """The folder a run reads (``paths.data_dir``), resolved with ``$MEDSRL_ROOT`` as ``paths.root_dir``."""
    root = Path(os.environ.get("MEDSRL_ROOT", ROOT))
    clone = data_dir_default(root)
    if clone is not None:
        return clone
    paths = OmegaConf.load(PATHS_CONFIG)
    paths.root_dir = str(root)
    return Path(OmegaConf.create({"paths": paths}).paths.data_dir)


def select(only: Sequence[str] | None) -> list[DataFile]:
    """The files named by folder (``deepscaler_eval``) or path (``deepscaler_eval/amc.json``),
    in manifest order; all when ``only`` is empty. An unknown name is a ValueError."""
    names = [n.strip().rstrip("/") for item in only or [] for n in item.split(",") if n.strip()]
    if not names:
        return list(MANIFEST)
    known = {f.name for f in MANIFEST} | {f.local for f in MANIFEST}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown data file(s) {unknown}; known: {sorted({f.name for f in MANIFEST})} "
                         "or a file's path under them")
    return [f for f in MANIFEST if f.name in names or f.local in names]


def url_for(entry: DataFile, base: str = DEFAULT_BASE) -> str:
    """``base`` with ``{repo} {owner} {repo_name} {commit} {path} {local}`` filled in; a base
    without ``{`` is a mirror of the data root: ``<base>/<local>``."""
    if "{" not in base:
        return f"{base.rstrip('/')}/{entry.local}"
    owner, _, name = entry.repo.partition("/")
    return base.format(repo=entry.repo, owner=owner, repo_name=name, commit=entry.commit,
                       path=entry.path, local=entry.local)


def _stream(src: BinaryIO, out: BinaryIO | None = None) -> tuple[str, int]:
    """Read ``src`` to its end, copied into ``out`` if given: its sha256 and size."""
    digest, size = hashlib.sha256(), 0
    while chunk := src.read(CHUNK):
        digest.update(chunk)
        if out is not None:
            out.write(chunk)
        size += len(chunk)
    return digest.hexdigest(), size


def sha256_of(path: Path) -> str:
    with path.open("rb") as f:
        return _stream(f)[0]


def download(entry: DataFile, url: str, dest: Path) -> int:
    """Fetch ``url`` to ``dest`` through a temp file in its folder, renamed only once its sha256
    is the recorded one (nothing is left otherwise); returns the bytes written."""
    tmp: Path | None = None
    new_folder = not dest.parent.exists()
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
        tmp = Path(name)
        request = urllib.request.Request(url, headers={"User-Agent": "medsrl-data"})
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(request, timeout=TIMEOUT_S) as src:
            got, size = _stream(src, out)
        if got != entry.sha256:
            raise FetchError(f"{entry.local}: sha256 mismatch for {url}: expected {entry.sha256}, "
                             f"got {got} ({size} bytes, expected {entry.size}); nothing written")
        os.chmod(tmp, 0o644)
        os.replace(tmp, dest)
        tmp = None
        return size
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as e:
        raise FetchError(f"{entry.local}: cannot fetch {url}: {e}") from e
    finally:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
            if new_folder and not any(dest.parent.iterdir()):
                dest.parent.rmdir()


def fetch_one(entry: DataFile, root: Path, base: str) -> Outcome:
    """Keep the file when its sum is right, else fetch it (replacing a wrong one)."""
    dest = root / entry.local
    replaced = ""
    if dest.is_file():
        got = sha256_of(dest)
        if got == entry.sha256:
            return Outcome(entry.local, "already there")
        replaced = f"; replaced a file with sha256 {got}"
    url = url_for(entry, base)
    try:
        size = download(entry, url, dest)
    except FetchError as e:
        return Outcome(entry.local, "FAILED", str(e))
    return Outcome(entry.local, "fetched", f"{size} bytes from {url}{replaced}")


def check_one(entry: DataFile, root: Path) -> Outcome:
    """Verify only: the file is there with the recorded sum."""
    dest = root / entry.local
    if not dest.is_file():
        return Outcome(entry.local, "FAILED", f"{entry.local}: missing ({dest})")
    got = sha256_of(dest)
    if got != entry.sha256:
        return Outcome(entry.local, "FAILED", f"{entry.local}: sha256 mismatch ({dest}): expected "
                                              f"{entry.sha256}, got {got}")
    return Outcome(entry.local, "ok")


def report(outcomes: list[Outcome], root: Path) -> None:
    for o in outcomes:
        print(f"  {o.status:<13} {o.local}{f'  ({o.detail})' if o.detail and not o.failed else ''}")
    for o in outcomes:
        if o.failed:
            print(f"medsrl-data: FAILED {o.detail}", file=sys.stderr)
    counts = {s: sum(o.status == s for o in outcomes) for s in STATUSES}
    summary = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    print(f"medsrl-data: {len(outcomes)} file(s) under {root}: {summary}")


def list_manifest() -> None:
    for f in MANIFEST:
        print(f"{f.local}\n  github.com/{f.repo} {f.path} @ {f.commit}\n  sha256 {f.sha256}, "
              f"{f.size} bytes\n  license: {f.license}")
        if f.note:
            print(f"  note: {f.note}")


def main(argv: Sequence[str] | None = None) -> int:
    """0 when every selected file is there with its sum, 1 when one failed, 2 on bad arguments."""
    ap = argparse.ArgumentParser(
        prog="medsrl-data",
        description="Fetch the benchmark and training files from their recorded public sources "
                    "(commit and sha256 pinned, src/medsrl/data/sources.py) into the data root.")
    ap.add_argument("--root", type=Path, default=None,
                    help="where to put them (default: the configs' paths.data_dir: $MEDSRL_DATA_DIR, "
                         "else ../shared/data if it exists, else <repo>/data)")
    ap.add_argument("--only", nargs="+", metavar="NAME",
                    help="only these folders (aime24 deepscaler_eval ...) or files (amc23/test.jsonl)")
    ap.add_argument("--base", default=DEFAULT_BASE,
                    help="URL template ({repo} {owner} {repo_name} {commit} {path} {local}) or a mirror "
                         "of the data root, e.g. file:///path/to/shared/data (default: %(default)s)")
    ap.add_argument("--check", action="store_true", help="verify the files there, fetch nothing")
    ap.add_argument("--list", action="store_true", help="print the manifest (sources, sums, licences)")
    args = ap.parse_args(argv)
    if args.list:
        list_manifest()
        return 0
    try:
        entries = select(args.only)
    except ValueError as e:
        print(f"medsrl-data: {e}", file=sys.stderr)
        return 2
    root = Path(os.path.abspath(args.root if args.root is not None else default_root()))
    if args.check:
        print(f"medsrl-data: checking {len(entries)} file(s) under {root}")
        outcomes = [check_one(e, root) for e in entries]
    else:
        print(f"medsrl-data: {len(entries)} file(s) into {root} from {args.base}")
        outcomes = [fetch_one(e, root, args.base) for e in entries]
    report(outcomes, root)
    return 1 if any(o.failed for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
