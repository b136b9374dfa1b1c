"""The columnar helper: exact round trips, errors that name the column, a stable digest."""

from dataclasses import dataclass

import numpy as np
import pytest

from medsrl.utils.columnar import Column, Format, check, digest, pack, to_columns, to_rows

COLUMNS = (
    Column("step", np.int64),
    Column("note", str, nullable=True),
    Column("ids", np.int64, ragged=True),
    Column("lp", np.float32, ragged=True, nullable=True),
)
FMT = Format("Thing", "medsrl.thing", 1)


@dataclass
class Row:
    step: int
    note: str | None
    ids: tuple
    lp: tuple | None


ROWS = [Row(3, "é", (1, 2), (-0.5, -0.25)), Row(4, None, (), None), Row(5, "x", (7,), (-1.0,))]


@pytest.mark.parametrize("as_tensors", [False, True])
def test_rows_to_columns_and_back_is_exact(as_tensors):
    cols = to_columns(ROWS, COLUMNS)
    state = {**cols, **pack({"step": cols["step"], "note": cols["note"]}, as_tensors=as_tensors)}
    assert to_rows(check(state, COLUMNS, 3, "state"), COLUMNS, Row) == ROWS


def test_snapshot_round_trip(tmp_path):
    path = FMT.save_parquet(tmp_path / "t.parquet", to_columns(ROWS, COLUMNS), COLUMNS, cap=2)
    cols, meta = FMT.load_parquet(path, COLUMNS)
    assert meta == {"format": "medsrl.thing", "version": 1, "cap": 2}
    assert to_rows(check(cols, COLUMNS, None, str(path)), COLUMNS, Row) == ROWS
    with pytest.raises(ValueError, match="not a Thing snapshot"):
        Format("Thing", "medsrl.other", 1).load_parquet(path, COLUMNS)


def test_a_corrupt_column_is_named():
    cols = to_columns(ROWS, COLUMNS)
    with pytest.raises(ValueError, match="state: step is int32"):
        check({**cols, "step": cols["step"].astype(np.int32)}, COLUMNS, None, "state")
    with pytest.raises(ValueError, match="state: note has 2 entries, expected 3"):
        check({**cols, "note": cols["note"][:2]}, COLUMNS, None, "state")
    with pytest.raises(ValueError, match="state: lp has 2 values"):
        check({**cols, "lp": cols["lp"]._replace(values=cols["lp"].values[:2])}, COLUMNS, None, "state")
    with pytest.raises(ValueError, match="lacks 'ids'"):
        check({k: v for k, v in cols.items() if k != "ids"}, COLUMNS, None, "state")
    with pytest.raises(ValueError, match="not a Thing state"):
        FMT.check({"format": "medsrl.thing", "version": 2})


def test_digest_is_stable_and_sees_one_ulp():
    a = digest(to_columns(ROWS, COLUMNS), "h")
    assert a == digest(to_columns(list(ROWS), COLUMNS), "h") != digest(to_columns(ROWS, COLUMNS), "other")
    ulp = float(np.nextafter(np.float32(-1.0), np.float32(0)))
    assert digest(to_columns([*ROWS[:2], Row(5, "x", (7,), (ulp,))], COLUMNS), "h") != a
    assert digest(to_columns(ROWS[:2] + [Row(5, None, (7,), (-1.0,))], COLUMNS), "h") != a  # "x" vs None
