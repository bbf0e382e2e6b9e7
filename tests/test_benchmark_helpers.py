"""benchmarks/_helpers.py's CSV append: a file without the rows' columns ends in a message naming them (not csv's
traceback) and is left as it was; an empty file gets the header."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from _helpers import append_csv_rows  # noqa: E402


def test_an_older_csv_is_refused_by_the_columns_it_lacks_and_kept(tmp_path):
    old = tmp_path / "old.csv"
    old.write_text("cpu,objective\nx,classify\n")
    with pytest.raises(SystemExit, match="old.csv: its header has no column for attention, command"):
        append_csv_rows(str(old), [{"cpu": "y", "objective": "mpp", "attention": "exact"}])
    assert old.read_text() == "cpu,objective\nx,classify\n"


def test_an_empty_csv_gets_the_header(tmp_path):
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    append_csv_rows(str(empty), [{"cpu": "y", "objective": "mpp"}])
    assert empty.read_text().splitlines()[0] == "cpu,objective,command"
