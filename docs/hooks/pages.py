"""The code blocks of a tutorial page, as the test suite runs them and the notebooks hold them.

A page's ```python and ```bash blocks run in order (tests/test_docs.py); ```console blocks are shown, not run. What
a block prints is shown in the ```output (or ```output-varies) block right under it, nothing between the two.
"""
from __future__ import annotations

import doctest
import re
from dataclasses import dataclass

from markdown_it import MarkdownIt

RUN = ("python", "bash")
OUTPUT = ("output", "output-varies")
NUMBER = re.compile(r"[-+]?(?:\d[\d,]*\.?\d*|\.\d+)(?:e[-+]?\d+)?")


@dataclass
class Fence:
    lang: str
    code: str
    line: int  # the first line of its code, 1-based
    start: int  # the fence's own lines in the page, [start, end), 0-based
    end: int
    shows: int | None = None  # an output block: the index of the code block right above it


def fences(text: str) -> list[Fence]:
    """Every fenced block of a page's markdown, in order (markdown-it-py, CommonMark)."""
    out: list[Fence] = []
    prev = None  # the last top-level block before this one
    for t in MarkdownIt("commonmark").parse(text):
        if t.type == "fence":
            f = Fence(t.info.split()[0] if t.info else "", t.content, t.map[0] + 2, t.map[0], t.map[1])
            if f.lang in OUTPUT and prev is not None and prev.type == "fence" and out and out[-1].lang in RUN:
                f.shows = len(out) - 1
            out.append(f)
        if t.level == 0 and t.nesting >= 0:
            prev = t
    return out


def outputs(blocks: list[Fence]) -> dict[int, Fence]:
    """The output block under each code block that has one, by the code block's index."""
    return {f.shows: f for f in blocks if f.shows is not None}


def shows(want: str, got: str, varies: bool) -> bool:
    """Whether an output block's text ``want`` shows what its code printed, ``got``: ``...`` stands for any text
    (doctest's ELLIPSIS), runs of spaces are one, and with ``varies`` every number may differ."""
    if varies:
        want, got = NUMBER.sub("0", want), NUMBER.sub("0", got)
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    return doctest.OutputChecker().check_output(want.strip() + "\n", got.strip() + "\n", flags)


_GENERATED: list[str] = []  # the folder the hooks write generated files into, made once per process


def generated_file(config, src_uri: str, content: str | bytes):  # type: ignore[no-untyped-def]
    """A file the build makes (a figure, a notebook, a page) as a MkDocs File. Written to a folder of its own
    rather than ``File.generated``: mkdocs-static-i18n (the Korean edition) needs every file on disk."""
    import tempfile
    from pathlib import Path

    from mkdocs.structure.files import File

    if not _GENERATED:
        _GENERATED.append(tempfile.mkdtemp(prefix="vitkit-docs-"))
    path = Path(_GENERATED[0]) / src_uri
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return File(src_uri, _GENERATED[0], config["site_dir"], config["use_directory_urls"])
