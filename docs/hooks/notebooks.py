"""MkDocs hook: every tutorial also as a Jupyter notebook, made from the page at each build (jupytext), so the two
never differ: ``tutorials/NAME.ipynb`` beside ``tutorials/NAME.md``, linked at the top of the page.

The page's ```python blocks become code cells, its ```bash blocks ``%%bash`` cells, the prose markdown cells, and
what each block printed on the page (its ```output block) that cell's output. ```console blocks (not run) stay
in the prose.

A notebook is read away from the site, downloaded on its own, so nothing in it may point next to it: the figures
the page shows are embedded in their cells (attachments; a figure drawn at the build is linked on the published
site instead), a link to another tutorial goes to that tutorial's notebook beside it (``tutorials/notebooks.zip``
holds them all, so a folder of them reads offline), a link to any other page to the published site (``site_url``),
and an exercise's solution (the
page's ``/// details | Solution`` block) becomes an empty cell for the reader's answer followed by the solution's
cells, their input collapsed (JupyterLab's and Notebook 7's ``source_hidden``).
"""
from __future__ import annotations

import base64
import posixpath
import re
from pathlib import Path

from pages import OUTPUT, RUN, fences, generated_file, outputs

LINK = {"ko": "이 페이지를 노트북으로 받기", "en": "Download this page as a notebook"}
ALL = {"ko": "모든 페이지", "en": "every page"}
ZIP = {"ko": "notebooks.ko.zip", "en": "notebooks.zip"}
ANSWER = {"ko": "# 여기에 답을 쓰세요 (풀이는 아래에 접혀 있습니다)",
          "en": "# Your answer here (the solution is below, collapsed)"}
SOLUTION = {"ko": "**풀이** (접혀 있습니다: 펼쳐 보세요)",
            "en": "**Solution** (collapsed: expand the cell below to see it)"}
DOCS = Path(__file__).resolve().parents[1]
IMAGE = re.compile(r"!\[(?P<alt>[^\]]*)\]\((?P<src>[^)\s]+\.png)\)")
PAGE_LINK = re.compile(r"(?<!!)\[(?P<text>[^\]]+)\]\((?P<href>(?!https?:|#)[^)\s]+?\.md)(?P<anchor>#[^)\s]*)?\)")
DETAILS = re.compile(r"^/// details \| .*$")


def _site_path(src_uri: str, href: str) -> str:
    """The published path (under ``site_url``) of ``href`` (a file relative to the page ``src_uri``)."""
    return posixpath.normpath(posixpath.join(posixpath.dirname(src_uri), href))


def _page_url(site_url: str, lang: str, src_uri: str, href: str) -> str:
    path = _site_path(src_uri, href).removesuffix(".md").removesuffix(".ko")
    path = "" if path == "index" else path.removesuffix("/index") + "/"
    return site_url + ("ko/" if lang == "ko" else "") + path


def _solutions(lines: list[str], lang: str) -> tuple[list[str], set[int]]:
    """The page's lines (its code blocks all ```python by now) with each ``/// details`` solution turned into an
    answer cell, a note and its code; and the solutions' code blocks, counted among the page's code blocks."""
    code = [f for f in fences("".join(lines)) if f.lang == "python"]
    solution: set[int] = set()
    out = list(lines)
    opened = None
    for n in range(len(lines) - 1, -1, -1):  # from the bottom, so that the line numbers above stay right
        line = lines[n].rstrip("\n")
        if line == "///" and opened is None:
            opened = n
        elif DETAILS.match(line) and opened is not None:
            solution.update(k for k, f in enumerate(code) if n < f.start < opened)
            body = lines[n + 1:opened]
            if body and body[0].strip().startswith("type:"):
                body = body[1:]
            if not any(n < f.start < opened for f in code):  # a solution in words: folded in the cell
                body = ["<details><summary>" + SOLUTION[lang].split(" (")[0].strip("*") + "</summary>\n", "\n",
                        *body, "\n", "</details>\n"]
                out[n:opened + 1] = body
            else:
                out[n:opened + 1] = ["```python\n", ANSWER[lang] + "\n", "```\n", "\n", SOLUTION[lang] + "\n",
                                     *body]
            opened = None
    return out, solution


def _detach(cell, src_uri: str, site_url: str, lang: str) -> None:  # type: ignore[no-untyped-def]
    """A markdown cell that reads the same away from the site: figures embedded, page links to the site."""
    attachments = {}

    def figure(m: re.Match) -> str:
        path = _site_path(src_uri, m["src"])
        for root in (DOCS, DOCS.parent):  # docs/figures/..., or results/... (published at the same path)
            if (root / path).is_file():
                name = path.replace("/", "-")
                attachments[name] = {"image/png": base64.b64encode((root / path).read_bytes()).decode()}
                return f"![{m['alt']}](attachment:{name})"
        return f"![{m['alt']}]({site_url}{path})"  # drawn at the build: on the published site

    def page(m: re.Match) -> str:
        target = _site_path(src_uri, m["href"])
        if target.startswith("tutorials/") and (DOCS / target).is_file():  # its notebook, beside this one
            name = target.removesuffix(".md").removesuffix(".ko")
            name += ".ko" if lang == "ko" and (DOCS / f"{name}.ko.md").is_file() else ""
            return f"[{m['text']}]({posixpath.basename(name)}.ipynb)"
        return f"[{m['text']}]({_page_url(site_url, lang, src_uri, m['href'])}{m['anchor'] or ''})"

    cell.source = PAGE_LINK.sub(page, IMAGE.sub(figure, cell.source))
    if attachments:
        cell.attachments = attachments


def notebook(text: str, src_uri: str = "tutorials/page.md", site_url: str = "",  # type: ignore[no-untyped-def]
             lang: str = "en"):
    """The notebook of a page's markdown ``text`` (an nbformat v4 NotebookNode); ``src_uri`` is the page's path
    in docs/, ``site_url`` where the site is published."""
    import jupytext  # the docs extra
    import nbformat

    blocks = fences(text)
    shown = outputs(blocks)
    lines = text.splitlines(keepends=True)
    for f in reversed(blocks):  # from the bottom, so that the line numbers above stay right
        if f.lang in OUTPUT and f.shows is not None:
            del lines[f.start:f.end + (lines[f.end:f.end + 1] == ["\n"])]
        elif f.lang == "bash":
            lines[f.start:f.end] = ["```python\n", "%%bash\n", *f.code.splitlines(keepends=True), "```\n"]
    lines, solution = _solutions(lines, lang)
    nb = jupytext.reads("".join(lines), fmt="md")
    runs = [i for i, f in enumerate(blocks) if f.lang in RUN]
    cells = [c for c in nb.cells if c.cell_type == "code" and c.source != ANSWER[lang]]
    if len(cells) != len(runs):
        raise ValueError(f"{len(runs)} code blocks became {len(cells)} notebook cells")
    for n, (cell, i) in enumerate(zip(cells, runs), 1):
        cell.execution_count = n
        if i in shown:
            cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=shown[i].code)]
        if n - 1 in solution:
            cell.metadata["jupyter"] = {"source_hidden": True}
            cell.metadata["tags"] = ["solution"]
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            _detach(cell, src_uri, site_url, lang)
    nb.metadata = {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
                   "language_info": {"name": "python"}}
    nbformat.validate(nb)
    return nb


def _site_url(config) -> str:  # type: ignore[no-untyped-def]
    url = config.get("site_url") or ""
    return url if url.endswith("/") else url + "/"


def _language(src_uri: str) -> str:
    return "ko" if src_uri.endswith(".ko.md") else "en"


def _zip(notebooks: dict[str, str]) -> bytes:
    import io
    import zipfile

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as z:
        for name, text in sorted(notebooks.items()):
            z.writestr(f"vitkit-tutorials/{name}", text)
    return buffer.getvalue()


def on_files(files, config):  # type: ignore[no-untyped-def]
    import nbformat
    made: dict[str, dict[str, str]] = {"en": {}, "ko": {}}
    for f in list(files):
        if f.src_uri.startswith("tutorials/") and f.src_uri.endswith(".md"):
            lang = _language(f.src_uri)
            nb = nbformat.writes(notebook(Path(f.abs_src_path).read_text(), f.src_uri, _site_url(config), lang))
            files.append(generated_file(config, f.src_uri[:-3] + ".ipynb", nb))
            made[lang][Path(f.src_uri).name[:-3] + ".ipynb"] = nb
    for lang, notebooks in made.items():  # every page's notebook in one download, so their links to each other work
        if notebooks:
            files.append(generated_file(config, f"tutorials/{ZIP[lang]}", _zip(notebooks)))
    return files


def on_page_markdown(markdown, page, config, files):  # type: ignore[no-untyped-def]
    src = page.file.src_uri
    if not (src.startswith("tutorials/") and src.endswith(".md")):
        return markdown
    name, lang = Path(src).name[:-3] + ".ipynb", _language(src)
    title, _, rest = markdown.partition("\n")
    return (f"{title}\n\n[{LINK[lang]}]({name}){{ download }} ([{ALL[lang]}]({ZIP[lang]}){{ download }})\n"
            f"{printed_on(src)}{rest}")


PRINTED = {"en": "The outputs on this page were printed on {machine} with torch {torch} on {date}; the whole page "
                 "ran in {seconds} s there.",
           "ko": "이 페이지의 출력은 {machine}에서 torch {torch}로 {date}에 찍은 것입니다. 그 기계에서 페이지 전체가 "
                 "{seconds}초 걸렸습니다."}


def printed_on(src_uri: str) -> str:
    """The line that names the machine a tutorial's outputs come from (tests/test_docs.py --update --refresh writes
    docs/tutorials/printed-on.json)."""
    import json

    english = Path(src_uri).name.split(".")[0] + ".md"
    path = DOCS / "tutorials" / "printed-on.json"
    known = json.loads(path.read_text()) if path.exists() else {}
    if english not in known:
        return ""
    return "\n<small>" + PRINTED[_language(src_uri)].format(**known[english]) + "</small>\n"
