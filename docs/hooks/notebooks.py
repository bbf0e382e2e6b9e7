"""MkDocs hook: every tutorial also as a Jupyter notebook, made from the page at each build (jupytext), so the two
never differ: ``tutorials/NAME.ipynb`` beside ``tutorials/NAME.md``, linked at the top of the page.

The page's ```python blocks become code cells, its ```bash blocks ``%%bash`` cells, the prose markdown cells, and
what each block printed on the page (its ```output block) that cell's output. ```console blocks (not run) stay
in the prose.
"""
from __future__ import annotations

from pathlib import Path

from pages import OUTPUT, RUN, fences, generated_file, outputs

LINK = {"ko": "이 페이지를 노트북으로 받기", "en": "Download this page as a notebook"}


def notebook(text: str):  # type: ignore[no-untyped-def]
    """The notebook of a page's markdown ``text`` (an nbformat v4 NotebookNode)."""
    import jupytext  # the docs extra
    import nbformat

    blocks = fences(text)
    shown = outputs(blocks)
    lines = text.splitlines(keepends=True)
    for f in reversed(blocks):  # from the bottom, so that the line numbers above stay right
        if f.lang in OUTPUT and f.shows is not None:
            del lines[f.start:f.end]
        elif f.lang == "bash":
            lines[f.start:f.end] = ["```python\n", "%%bash\n", *f.code.splitlines(keepends=True), "```\n"]
    nb = jupytext.reads("".join(lines), fmt="md")
    cells = [c for c in nb.cells if c.cell_type == "code"]
    runs = [i for i, f in enumerate(blocks) if f.lang in RUN]
    if len(cells) != len(runs):
        raise ValueError(f"{len(runs)} code blocks became {len(cells)} notebook cells")
    for n, (cell, i) in enumerate(zip(cells, runs), 1):
        cell.execution_count = n
        if i in shown:
            cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=shown[i].code)]
    nb.metadata = {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
                   "language_info": {"name": "python"}}
    nbformat.validate(nb)
    return nb


def _language(src_uri: str) -> str:
    return "ko" if src_uri.endswith(".ko.md") else "en"


def on_files(files, config):  # type: ignore[no-untyped-def]
    import nbformat
    for f in list(files):
        if f.src_uri.startswith("tutorials/") and f.src_uri.endswith(".md"):
            nb = notebook(Path(f.abs_src_path).read_text())
            files.append(generated_file(config, f.src_uri[:-3] + ".ipynb", nbformat.writes(nb)))
    return files


def on_page_markdown(markdown, page, config, files):  # type: ignore[no-untyped-def]
    src = page.file.src_uri
    if not (src.startswith("tutorials/") and src.endswith(".md")):
        return markdown
    name = Path(src).name[:-3] + ".ipynb"
    title, _, rest = markdown.partition("\n")
    return f"{title}\n\n[{LINK[_language(src)]}]({name}){{ download }}\n{rest}"
