"""MkDocs hooks: the site shows the committed results (results/*.csv and the claims' figures) and the command
line's own --help, so neither can go stale in the text.

- every file under ``results/`` is published at the same path, so a page links ``../results/data-size/figure.png``;
- ``<!-- csv: results/FILE.csv [| col,col,...] -->`` becomes a table of that CSV (those columns, in that order);
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
HELP = re.compile(r"<!-- cli-help: (?P<cmd>[\w-]+) -->")


def on_files(files, config):  # type: ignore[no-untyped-def]
    for path in sorted((ROOT / "results").rglob("*")):
        if path.suffix in (".png", ".csv") and "runs" not in path.relative_to(ROOT / "results").parts:
            files.append(File(str(path.relative_to(ROOT)), str(ROOT), config["site_dir"], config["use_directory_urls"]))
    return files


def csv_table(path: str, cols: str | None, page_uri: str) -> str:
    with open(ROOT / path, newline="") as f:
        reader = csv.DictReader(f)
        rows, header = list(reader), reader.fieldnames or []
    names = cols.split(",") if cols else header
    missing = [c for c in names if c not in header]
    if missing or not rows:
        raise ValueError(f"{path}: " + (f"no column(s) {missing}; it has {header}" if missing else "no rows"))
    cell = lambda v: (v or "").replace("|", "\\|").replace("\n", " ")  # noqa: E731
    lines = ["| " + " | ".join(names) + " |", "|" + "---|" * len(names)]
    lines += ["| " + " | ".join(cell(r[c]) for c in names) + " |" for r in rows]
    link = posixpath.relpath(path, posixpath.dirname(page_uri) or ".")
    return "\n".join(lines) + f"\n\n<small>From [`{path}`]({link}).</small>"


def cli_help(command: str) -> str:
    from vitkit.cli.main import build_parser  # the installed package's own parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    return "```text\n" + sub.format_help() + "```"


def on_page_markdown(markdown, page, config, files):  # type: ignore[no-untyped-def]
    markdown = CSV.sub(lambda m: csv_table(m["path"], m["cols"], page.file.src_uri), markdown)
    return HELP.sub(lambda m: cli_help(m["cmd"]), markdown)
