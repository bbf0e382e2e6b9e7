"""MkDocs hooks: the site shows the committed results (results/*.csv and the claims' figures) and the command
line's own --help, so neither can go stale in the text.

- every file under ``results/`` is published at the same path, so a page links ``../results/data-size/figure.png``;
- a table of a CSV sits in the page itself, so that GitHub shows it too, between ``<!-- csv: results/FILE.csv
  [| col,col,...] -->`` (those columns, in that order) or ``<!-- csv-pivot: results/FILE.csv | ROW | COLUMN |
  VALUE -->`` (a row per value of ROW, a column per value of COLUMN, e.g. one per CPU kind) and ``<!-- /csv -->``.
  ``python docs/hooks/results.py`` writes them from the CSVs; the build fails (strict) on a table that is not
  what its CSV holds. On a Korean page (``*.ko.md``) the columns, the prose cells and the caption are Korean, from
  ``tables.ko.yaml`` beside this file;
- ``<!-- cli-help: COMMAND -->`` becomes ``vitkit COMMAND --help``.
"""
from __future__ import annotations

import csv
import logging
import posixpath
import re
import sys
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
TABLE = re.compile(r"(?P<open><!-- (?P<kind>csv|csv-pivot): (?P<args>[^>]*?) -->)\n(?P<body>.*?)<!-- /csv -->", re.S)
HELP = re.compile(r"<!-- cli-help: (?P<cmd>[\w-]+) -->")
log = logging.getLogger("mkdocs.hooks.results")
PROSE = re.compile(r"(?=.*\s)(?=.*[a-z]{3,})")  # a cell of words and spaces: a sentence to translate, not a name


def on_files(files, config):  # type: ignore[no-untyped-def]
    from mkdocs.structure.files import File  # only when MkDocs runs this file as a hook

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
    for n, r in enumerate(rows, start=2):  # an unquoted comma splits a cell: the row has more fields than the header
        if None in r or None in r.values():
            raise ValueError(f"{path}, line {n}: {len(header)} columns expected ({', '.join(header)}); "
                             "a cell holding a comma must be quoted")
    names = cols or header
    missing = [c for c in names if c not in header]
    if missing or not rows:
        raise ValueError(f"{path}: " + (f"no column(s) {missing}; it has {header}" if missing else "no rows"))
    return names, rows


@lru_cache(maxsize=1)
def korean() -> dict:
    import yaml

    return yaml.safe_load((Path(__file__).parent / "tables.ko.yaml").read_text())


class Untranslated(ValueError):
    """A Korean page's table has a column or a prose cell that tables.ko.yaml does not translate."""


def translated(column: str, value: str | None = None) -> str:
    """The Korean name of ``column`` or, given ``value``, that cell's Korean text (a value a user types, with no
    words and spaces, stays as it is)."""
    ko = korean()
    if value is None:
        if column not in ko["columns"]:
            raise Untranslated(f"column {column!r}: no Korean name in docs/hooks/tables.ko.yaml (columns:)")
        return ko["columns"][column]
    found = ko["cells"].get(column, {}).get(value)
    if found is None and PROSE.match(value):
        raise Untranslated(f"column {column!r}, cell {value!r}: no Korean text in docs/hooks/tables.ko.yaml (cells:)")
    return value if found is None else found


def markdown_table(names: list[str], rows: list[list[str]], path: str, link: str, ko: bool = False) -> str:
    """The table with its caption (in Korean when ``ko``)."""
    cell = lambda v: (v or "").replace("|", "\\|").replace("\n", " ")  # noqa: E731
    lines = ["| " + " | ".join(cell(n) for n in names) + " |", "|" + "---|" * len(names)]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    caption = f"출처: [`{path}`]({link})." if ko else f"From [`{path}`]({link})."
    return "\n".join(lines) + f"\n\n<small>{caption}</small>\n"


def csv_table(path: str, cols: str | None, link: str, ko: bool = False) -> str:
    names, rows = read_csv(path, cols.split(",") if cols else None)
    body = [[translated(c, r[c]) if ko else r[c] for c in names] for r in rows]
    return markdown_table([translated(c) for c in names] if ko else names, body, path, link, ko)


def csv_pivot(path: str, row: str, col: str, value: str, link: str, ko: bool = False) -> str:
    """One table row per ``row`` value, one column per ``col`` value (in the CSV's order); several rows with the
    same pair (repeated runs) share a cell, their values joined by "; "; a pair without rows is "–"."""
    _, rows = read_csv(path, [row, col, value])
    keys = list(dict.fromkeys(r[row] for r in rows))
    cols = list(dict.fromkeys(r[col] for r in rows))
    cells: dict[tuple[str, str], list[str]] = {}
    for r in rows:
        cells.setdefault((r[row], r[col]), []).append(r[value])
    body = [[k] + ["; ".join(cells.get((k, c), ["–"])) for c in cols] for k in keys]
    if ko:  # a pivot's column names are values of ``col``, its cells values of ``value`` beside one of ``row``
        body = [[translated(row, r[0])] + [translated(value, v) for v in r[1:]] for r in body]
        return markdown_table([translated(row)] + [translated(col, c) for c in cols], body, path, link, ko)
    return markdown_table([row] + cols, body, path, link)


def table_for(kind: str, args: str, link_from: str, ko: bool = False) -> str:
    """The table a marker asks for; its link to the CSV relative to ``link_from`` (a folder, posix); in Korean
    when ``ko``."""
    parts = [a.strip() for a in args.split("|")]
    link = posixpath.relpath(parts[0], link_from)
    if kind == "csv":
        return csv_table(parts[0], parts[1] if len(parts) > 1 else None, link, ko)
    return csv_pivot(parts[0], parts[1], parts[2], parts[3], link, ko)


def write_tables(text: str, page: Path) -> str:
    """``text`` (the markdown of ``page``, a path in docs/) with every marked table as its CSV holds it, linked
    from the page's place in the repository (GitHub's view)."""
    here = posixpath.relpath(page.parent.as_posix(), ROOT.as_posix())
    ko = page.name.endswith(".ko.md")
    return TABLE.sub(lambda m: f"{m['open']}\n{table_for(m['kind'], m['args'], here, ko)}<!-- /csv -->", text)


def cli_help(command: str) -> str:
    from vitkit.cli.main import build_parser  # the installed package's own parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    return "```text\n" + sub.format_help() + "```"


def on_page_markdown(markdown, page, config, files):  # type: ignore[no-untyped-def]
    src = DOCS / page.file.src_uri
    if write_tables(markdown, src) != markdown:
        log.warning(f"{page.file.src_uri}: a table is not what its CSV holds; run `python docs/hooks/results.py`")
    site_dir = posixpath.dirname(page.file.src_uri) or "."  # results/ is published inside the site at its own path
    ko = page.file.src_uri.endswith(".ko.md")
    markdown = TABLE.sub(lambda m: table_for(m["kind"], m["args"], site_dir, ko), markdown)
    return HELP.sub(lambda m: cli_help(m["cmd"]), markdown)


# python docs/hooks/results.py: write every page's tables from the CSVs (after adding rows to results/)
if __name__ == "__main__":
    for md in sorted(DOCS.rglob("*.md")):
        old = md.read_text()
        new = write_tables(old, md)
        if new != old:
            md.write_text(new)
            print(f"{md.relative_to(ROOT)}: tables written", file=sys.stderr)
