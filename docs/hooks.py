"""MkDocs hooks: the site shows the committed results (results/*.csv and the claims' figures) and the command
line's own --help, so neither can go stale in the text.

- every file under ``results/`` is published at the same path, so a page links ``../results/data-size/figure.png``;
- ``<!-- csv: results/FILE.csv [| col,col,...] -->`` becomes a table of that CSV (those columns, in that order);
- ``<!-- csv-pivot: results/FILE.csv | ROW | COLUMN | VALUE -->`` becomes a table with a row per value of ROW and a
  column per value of COLUMN (e.g. one column per CPU kind), the cells the VALUEs of the matching rows;
- ``<!-- cli-help: COMMAND -->`` becomes ``vitkit COMMAND --help``.
"""
from __future__ import annotations

import csv
import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
CSV = re.compile(r"<!-- csv: (?P<path>\S+)(?: \| (?P<cols>[^ ]+))? -->")
PIVOT = re.compile(r"<!-- csv-pivot: (?P<path>\S+) \| (?P<row>[^ |]+) \| (?P<col>[^ |]+) \| (?P<value>[^ |]+) -->")
HELP = re.compile(r"<!-- cli-help: (?P<cmd>[\w-]+) -->")


def on_files(files, config):  # type: ignore[no-untyped-def]
    for path in sorted((ROOT / "results").rglob("*")):
        if path.suffix in (".png", ".csv") and "runs" not in path.relative_to(ROOT / "results").parts:
            files.append(File(str(path.relative_to(ROOT)), str(ROOT), config["site_dir"], config["use_directory_urls"]))
    return files


def read_csv(path: str, cols: list[str] | None = None) -> tuple[list[str], list[dict[str, str]]]:
    """The columns ``cols`` (default: all) and the rows of ``path`` (relative to the project), checked to have those
    columns and at least one row."""
    with open(ROOT / path, newline="") as f:
        reader = csv.DictReader(f)
        rows, header = list(reader), reader.fieldnames or []
    names = cols or header
    missing = [c for c in names if c not in header]
    if missing or not rows:
        raise ValueError(f"{path}: " + (f"no column(s) {missing}; it has {header}" if missing else "no rows"))
    return names, rows


def markdown_table(names: list[str], rows: list[list[str]], path: str, page_uri: str) -> str:
    cell = lambda v: (v or "").replace("|", "\\|").replace("\n", " ")  # noqa: E731
    lines = ["| " + " | ".join(cell(n) for n in names) + " |", "|" + "---|" * len(names)]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    link = posixpath.relpath(path, posixpath.dirname(page_uri) or ".")
    return "\n".join(lines) + f"\n\n<small>From [`{path}`]({link}).</small>"


def csv_table(path: str, cols: str | None, page_uri: str) -> str:
    names, rows = read_csv(path, cols.split(",") if cols else None)
    return markdown_table(names, [[r[c] for c in names] for r in rows], path, page_uri)


def csv_pivot(path: str, row: str, col: str, value: str, page_uri: str) -> str:
    """One table row per ``row`` value, one column per ``col`` value (in the CSV's order); several rows with the
    same pair (repeated runs) share a cell, their values joined by "; "; a pair without rows is "–"."""
    _, rows = read_csv(path, [row, col, value])
    keys = list(dict.fromkeys(r[row] for r in rows))
    cols = list(dict.fromkeys(r[col] for r in rows))
    cells: dict[tuple[str, str], list[str]] = {}
    for r in rows:
        cells.setdefault((r[row], r[col]), []).append(r[value])
    body = [[k] + ["; ".join(cells.get((k, c), ["–"])) for c in cols] for k in keys]
    return markdown_table([row] + cols, body, path, page_uri)


def cli_help(command: str) -> str:
    from vitkit.cli.main import build_parser  # the installed package's own parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    return "```text\n" + sub.format_help() + "```"


def on_page_markdown(markdown, page, config, files):  # type: ignore[no-untyped-def]
    markdown = CSV.sub(lambda m: csv_table(m["path"], m["cols"], page.file.src_uri), markdown)
    markdown = PIVOT.sub(lambda m: csv_pivot(m["path"], m["row"], m["col"], m["value"], page.file.src_uri), markdown)
    return HELP.sub(lambda m: cli_help(m["cmd"]), markdown)
