"""The documentation site builds without warnings, and every tutorial runs as written and prints what it shows.

A tutorial is run top to bottom in a fresh folder: its ```python blocks in one namespace (as a reader pasting
them into one session would), its ```bash blocks in bash with this environment's ``vitkit`` on PATH, in the order
they appear, since the tutorials interleave the command line and Python. Blocks marked ```console are shown,
not run (they need the internet, a GPU or several machines, or run until stopped). pytest-markdown-docs runs only
Python blocks and mktestdocs runs each language apart, which loses that order, so the blocks are read with
markdown-it-py (the CommonMark parser rich uses) and run here.

What a block prints (stdout) is shown on the page in the ```output block right under it, and checked against it:
a block that prints with no output block under it, or prints something else, fails. ``...`` in an output block
stands for any text (doctest's ELLIPSIS); in an ```output-varies block every number may differ too (timings,
accuracies of a training run), the words and the layout may not. ``python tests/test_docs.py --update PAGE``
runs the page and writes what it printed where the page disagrees.
"""
from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs" / "hooks"))
from pages import OUTPUT, RUN, Fence, outputs, shows  # noqa: E402  the site's own reading of a page (docs/hooks)
from pages import fences as _fences  # noqa: E402

PAGES = sorted((ROOT / "docs" / "tutorials").glob("*.md"))
TUTORIALS = [p for p in PAGES if len(p.suffixes) == 1]  # NAME.md; its translations are NAME.ko.md and the like


def translations(page: Path) -> list[Path]:
    return sorted(page.parent.glob(page.name.replace(".md", ".*.md")))


def fences(page: Path) -> list[Fence]:
    return _fences(page.read_text())


def run_page(page: Path, cwd: Path) -> dict[int, str]:
    """Run every block of ``page`` in ``cwd``; returns what each printed, by its index in ``fences(page)``."""
    namespace: dict = {"__name__": "__main__"}
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               MPLBACKEND="Agg")
    printed: dict[int, str] = {}
    old = Path.cwd()
    os.chdir(cwd)
    try:
        for i, f in enumerate(fences(page)):
            if f.lang == "python":
                buf = io.StringIO()
                with contextlib.redirect_stdout(buf):
                    exec(compile("\n" * (f.line - 1) + f.code, str(page), "exec"), namespace)
                printed[i] = buf.getvalue()
            elif f.lang == "bash":
                done = subprocess.run(["bash", "-euo", "pipefail", "-c", f.code], cwd=cwd, env=env,
                                      capture_output=True, text=True)
                assert done.returncode == 0, (
                    f"{page.name}:{f.line}: exit {done.returncode}\n{f.code}\n{done.stderr[-3000:]}")
                printed[i] = done.stdout
    finally:
        os.chdir(old)
    return printed


def mismatches(page: Path, printed: dict[int, str]) -> list[str]:
    """Where the page does not show what its blocks printed, one message each."""
    blocks = fences(page)
    shown = outputs(blocks)
    bad = [f"{page.name}:{f.line}: an output block under no code block" for f in blocks
           if f.lang in OUTPUT and f.shows is None]
    for i, got in printed.items():
        want = shown.get(i)
        where = f"{page.name}:{blocks[i].line}"
        if want is None and got.strip():
            bad.append(f"{where}: prints, but the page shows no ```output block under it:\n{got}")
        elif want is not None and not shows(want.code, got, want.lang == "output-varies"):
            bad.append(f"{where}: printed\n{got}\nbut the page shows\n{want.code}")
    return bad


def update_page(page: Path, printed: dict[int, str], refresh: bool = False) -> int:
    """Write what the blocks printed into the page where it disagrees (a new output block where there is none);
    returns how many blocks changed. Output blocks that still match are kept as they are (with their ``...``),
    except, with ``refresh``, an ```output-varies block without ``...``: it then shows this run's numbers."""
    blocks = fences(page)
    lines = page.read_text().splitlines(keepends=True)
    shown = outputs(blocks)
    changed = 0
    for i in sorted(printed, reverse=True):  # from the bottom, so that earlier line numbers stay right
        got, want = printed[i].rstrip("\n"), shown.get(i)
        stale = refresh and want is not None and want.lang == "output-varies" and "..." not in want.code \
            and want.code.rstrip("\n") != got
        if want is not None and shows(want.code, got, want.lang == "output-varies") and not stale:
            continue
        if want is None and not got.strip():
            continue
        lang = want.lang if want is not None else "output"
        new = [f"```{lang}\n", *(line + "\n" for line in got.splitlines()), "```\n"]
        if want is not None:
            lines[want.start:want.end] = new
        else:
            lines[blocks[i].end:blocks[i].end] = new
        changed += 1
    page.write_text("".join(lines))
    return changed


# the team's real-photo sets (../shared/data, see its README): a page whose code reads one finds it in its folder
SHARED_DATA = [ROOT.parent / "shared" / "data", Path("/work/shared/data")]


PRINTED_ON = ROOT / "docs" / "tutorials" / "printed-on.json"


def record_printed_on(page: Path, seconds: float) -> None:
    """Write where and when a page's outputs were printed (``--update --refresh``) into PRINTED_ON, which the site
    shows at the top of the page: every number a page prints comes with its machine."""
    import datetime
    import json

    import torch

    from vitkit.runtime.cpu import machine_name

    known = json.loads(PRINTED_ON.read_text()) if PRINTED_ON.exists() else {}
    known[page.name] = {"machine": machine_name(torch.device("cpu")), "torch": torch.__version__.split("+")[0],
                        "date": datetime.date.today().isoformat(), "seconds": round(seconds)}
    PRINTED_ON.write_text(json.dumps(dict(sorted(known.items())), indent=1, ensure_ascii=False) + "\n")


def test_every_tutorial_says_where_its_outputs_were_printed() -> None:
    import json

    known = json.loads(PRINTED_ON.read_text())
    missing = [p.name for p in TUTORIALS if p.name not in known]
    assert not missing, f"no machine recorded for {missing}: run `python tests/test_docs.py --update --refresh PAGE`"
    for name, entry in known.items():
        assert {"machine", "torch", "date", "seconds"} <= set(entry), name
        assert "cores" in entry["machine"] or "GPU" in entry["machine"], entry


def link_shared_data(page: Path, cwd: Path) -> None:
    """Link the shared data files a page's code names into ``cwd``; skip the page where one is not on this machine."""
    code = "\n".join(f.code for f in fences(page) if f.lang in ("python", "bash"))
    for name in ("cifar10-jpg.zip", "ants-bees.zip"):
        if name in code:
            found = next((d / name for d in SHARED_DATA if (d / name).is_file()), None)
            if found is None:
                pytest.skip(f"{page.name} reads {name}, which is not in ../shared/data here")
            (cwd / name).symlink_to(found)


# Pages that load pretrained weights by name: run offline on a stand-in, timm's own save of random weights in a
# Hugging Face Hub cache (huggingface_hub's layout), made for the run; HF_HOME is set before anything imports it.
HUB_WEIGHTS = {"backbone.md": ["vit_small_patch14_reg4_dinov2.lvd142m"]}


def hub_stand_in(page: Path, folder: Path) -> None:
    """Point HF_HOME at a Hub cache in ``folder`` holding the stand-in weights ``page`` names (this process)."""
    os.environ.update(HF_HOME=str(folder / "hf"), HF_HUB_OFFLINE="1")
    sys.path.insert(0, str(ROOT / "tests"))
    from test_after_paper import _hub_cache  # writes folder/hf

    _hub_cache(folder, HUB_WEIGHTS[page.name])


@pytest.mark.long
@pytest.mark.parametrize("page", TUTORIALS, ids=[p.name.removesuffix(".md") for p in TUTORIALS])
def test_tutorial_runs_and_shows_what_it_prints(page: Path, tmp_path: Path) -> None:
    """The page and its translations, which run the same code (checked below): one run checks what each shows."""
    assert any(f.lang in ("python", "bash") for f in fences(page)), f"{page.name} has no code"
    if page.name in HUB_WEIGHTS:  # in a process of its own, whose HF_HOME is the stand-in's cache
        link_shared_data(page, tmp_path)  # here, so that a missing data file skips the test
        (tmp_path / "page").mkdir()
        done = subprocess.run([sys.executable, __file__, str(page), str(tmp_path / "page")], capture_output=True,
                              text=True, timeout=1500)
        assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
        return
    link_shared_data(page, tmp_path)
    printed = run_page(page, tmp_path)
    bad = [m for p in (page, *translations(page)) for m in mismatches(p, printed)]
    assert not bad, "\n\n".join(bad) + f"\n\n(`python tests/test_docs.py --update {page.relative_to(ROOT)}` " \
        "writes what the page printed; keep `...` where a value is not the page's point)"


CODE_WIDTH = 80  # what a code box on the site shows without scrolling (1280-pixel screen, menus open)


@pytest.mark.parametrize("page", PAGES, ids=[p.name.removesuffix(".md") for p in PAGES])
def test_code_lines_fit_the_code_box(page: Path) -> None:
    """No comment (a shape, say) hides past the right edge of a code box."""
    wide = [f"{page.name}:{f.line + i}: {len(line)} characters" for f in fences(page)
            if f.lang in ("python", "bash", "console") for i, line in enumerate(f.code.splitlines())
            if len(line) > CODE_WIDTH]
    assert not wide, f"code lines wider than {CODE_WIDTH} characters:\n" + "\n".join(wide)


def test_the_output_check_fails_on_a_page_that_shows_something_else(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text("```python\nprint('shape', (1, 197, 768))\n```\n\n```output\nshape (1, 196, 768)\n```\n\n"
                    "```bash\necho 'val_top1=97.22 elapsed_s=31.0'\n```\n\n```output-varies\n"
                    "val_top1=95.00 elapsed_s=28.4\n```\n\n```python\nprint('unshown')\n```\n\n"
                    "Text between.\n\n```output\nstray\n```\n")
    bad = mismatches(page, run_page(page, tmp_path))
    assert len(bad) == 3, bad
    assert "printed\nshape (1, 197, 768)" in bad[1] and "shows no ```output block" in bad[2]
    assert "output block under no code block" in bad[0]
    assert update_page(page, run_page(page, tmp_path)) == 2
    assert mismatches(page, run_page(page, tmp_path)) == [f"p.md:{fences(page)[-1].line}: an output block under "
                                                          "no code block"]
    assert shows("epoch 1 ...\nfinal: 9...%", "epoch 1 loss 2.3\nepoch 2 loss 1.1\nfinal: 97%", False)
    assert not shows("(1, 196, 768)", "(1, 197, 768)", False) and shows("196", "197", True)


@pytest.mark.parametrize("page", [p for p in PAGES if p not in TUTORIALS], ids=lambda p: p.name.removesuffix(".md"))
def test_a_translated_page_runs_and_shows_the_code_of_its_english_page(page: Path) -> None:
    """A translation changes the prose, never the code: the same blocks, the same outputs, in the same order (so
    the English page's run is this page's run)."""
    english = page.with_name(page.name.split(".")[0] + ".md")
    code = [[(f.lang, f.code) for f in fences(p) if f.lang in RUN + OUTPUT] for p in (page, english)]
    assert code[0] == code[1], f"{page.name} does not run the code of {english.name}"


@pytest.mark.long  # (17-43 s on a 2-core AVX2 EPYC: the default suite is kept under 10 minutes)
def test_site_builds_strict_offline_with_notebooks_figures_and_the_korean_edition(tmp_path: Path) -> None:
    import json

    import nbformat

    sys.path.insert(0, str(ROOT / "docs" / "hooks"))
    import annotated  # docs/hooks/annotated.py

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "NO_MKDOCS_2_WARNING": "1",
           "VITKIT_SITE_URL": "https://example.org/en/latest/"}  # as .github/workflows/docs.yml sets it
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-5000:]
    site = tmp_path / "site"
    assert (site / "reference" / "api" / "index.html").exists()
    page = (site / "tutorials" / "vit-shape-by-shape" / "index.html").read_text()
    assert "javascripts/katex/katex.min.js" in page and "cdn." not in page  # the renderer ships with the site
    assert 'class="output"' in page and "image (1, 3, 224, 224) patches 196" in page  # what the code printed
    for figure in ("patch-grid.png", "vit-diagram.png"):  # drawn at the build
        assert (site / "figures" / figure).stat().st_size > 10_000 and f"figures/{figure}" in page
    # every tutorial as a notebook, its code cells the page's blocks and their outputs what the page shows
    for md in TUTORIALS:
        name = md.name.removesuffix(".md")
        ipynb = site / "tutorials" / f"{name}.ipynb"
        nb = nbformat.reads(ipynb.read_text(), as_version=4)
        nbformat.validate(nb)
        blocks = [f for f in fences(md) if f.lang in RUN]
        cells = [c for c in nb.cells if c.cell_type == "code" and not c.source.startswith("# Your answer")]
        assert [c.source.removeprefix("%%bash\n") for c in cells] == [f.code.rstrip("\n") for f in blocks], md.name
        shown = outputs(fences(md))
        assert sum(bool(c.outputs) for c in cells) == len(shown), md.name
    assert 'href="vit-shape-by-shape.ipynb"' in page or "vit-shape-by-shape.ipynb" in page
    # the Korean edition: its own pages, the English ones where none is translated, the language switch
    ko = (site / "ko" / "tutorials" / "vit-shape-by-shape" / "index.html").read_text()
    assert "입력을 텐서 모양으로 따라가기" in ko and "image (1, 3, 224, 224) patches 196" in ko
    assert 'lang="ko"' in ko
    assert "이 페이지의 출력은" in ko  # the machine its outputs were printed on
    # every page of the learning path is in Korean; a page that is not yet says so in Korean
    for md in TUTORIALS:
        assert md.with_name(md.name[:-3] + ".ko.md").exists(), f"{md.name} has no Korean translation"
        assert "아직 영어" not in (site / "ko" / "tutorials" / md.name[:-3] / "index.html").read_text()
    assert "이 페이지는 아직 영어입니다" in (site / "ko" / "results" / "index.html").read_text()
    assert "이 페이지는 아직 영어입니다" not in (site / "results" / "index.html").read_text()
    # site_url: the sitemap and the language menu hold the published addresses, under its sub-path
    sitemap = (site / "sitemap.xml").read_text()
    assert "None" not in sitemap and "<loc>https://" in sitemap
    assert 'href="../../ko/tutorials/vit-shape-by-shape/" hreflang="ko"' in page  # relative: any sub-path works
    assert 'href="/en/latest/ko/" hreflang="ko"' in (site / "index.html").read_text()  # site_url's own path
    # a notebook downloaded on its own: figures embedded, links to the other tutorials' notebooks (all in one zip)
    # and to the published site, exercises to fill in
    nb = nbformat.reads((site / "tutorials" / "look-inside.ipynb").read_text(), as_version=4)
    prose = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    assert "../figures/" not in prose and ".md)" not in prose and "](https://example.org/en/latest/" in prose
    assert "](fine-tune.ipynb)" in prose, prose[:2000]
    with zipfile.ZipFile(site / "tutorials" / "notebooks.zip") as z:
        assert sorted(z.namelist()) == sorted(f"vitkit-tutorials/{md.name[:-3]}.ipynb" for md in TUTORIALS)
    with zipfile.ZipFile(site / "tutorials" / "notebooks.ko.zip") as z:  # the Korean notebooks, in a zip of their own
        assert "vitkit-tutorials/look-inside.ko.ipynb" in z.namelist()
    assert 'href="../notebooks.zip"' in (site / "tutorials" / "look-inside" / "index.html").read_text()
    ko_page = (site / "ko" / "tutorials" / "look-inside" / "index.html").read_text()
    assert 'href="../../../tutorials/notebooks.ko.zip"' in ko_page  # from ko/tutorials/look-inside/ to that zip
    assert any(c.get("attachments") for c in nb.cells if c.cell_type == "markdown")
    answer = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and c.source.startswith("# Your answer")]
    assert answer and all(nb.cells[i + 2].metadata["jupyter"]["source_hidden"] for i in answer)
    assert "/// details" not in prose
    assert "한국어" in page and "/ko/" in page
    # the annotated model holds every line of model/vit.py that is not a docstring
    annotated_page = (site / "reference" / "annotated-vit" / "index.html").read_text()
    source = annotated.SOURCE.read_text()
    code = "\n".join(c for _, _, c in annotated.sections(source))
    skip = annotated._docstring_lines(__import__("ast").parse(source))
    missing = [line for i, line in enumerate(source.splitlines(), 1)
               if i not in skip and line.strip() and line not in code]
    assert not missing and "class Attention" in annotated_page and "katex" in annotated_page, missing[:5]
    assert json.loads((site / "search" / "search_index.json").read_text())["docs"]
    _math_renders_offline(site / "tutorials" / "vit-shape-by-shape" / "index.html")
    _math_renders_offline(site / "ko" / "tutorials" / "vit-shape-by-shape" / "index.html")


def _math_renders_offline(page: Path) -> None:
    """Eq. 1-4 typeset in a real browser that may not reach the network (every request outside the site refused)."""
    import shutil

    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    sync_api = pytest.importorskip("playwright.sync_api")
    if not Path(chromium).exists():
        pytest.skip("Debian chromium not installed (.ci/run installs it)")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--headless", "--no-sandbox", "--disable-gpu"])
        try:
            ctx = browser.new_context()
            ctx.route("**/*", lambda r: r.continue_() if r.request.url.startswith("file://") else r.abort())
            tab = ctx.new_page()
            tab.goto(page.as_uri())
            tab.wait_for_selector(".arithmatex .katex", timeout=20_000)
            rendered = tab.locator(".arithmatex .katex").count()
            raw = tab.locator(".arithmatex").count()
            errors = tab.locator(".katex-error").count()
        finally:
            browser.close()
    assert rendered == raw > 4 and errors == 0  # every equation, none left as raw LaTeX


def test_no_diary_in_the_user_pages() -> None:
    """The facts stay on the user pages, keyed by CPU kind and date; how they came about (the working sessions)
    lives on one page, the measurement log."""
    found = []
    for md in sorted((ROOT / "docs").rglob("*.md")):
        if md.name == "measurement-log.md":
            continue
        text = md.read_text()
        code = {i for f in fences(md) for i in range(f.start, f.end)}
        found += [f"{md.relative_to(ROOT)}:{n + 1}: {line.strip()[:100]}" for n, line in enumerate(text.splitlines())
                  if n not in code and "session" in line.lower()]
    assert not found, "\n".join(found)


def test_a_notebook_turns_exercises_into_answer_cells_and_links_to_the_site(tmp_path: Path) -> None:
    import notebooks  # docs/hooks/notebooks.py

    page = ("# T\n\nSee [page 1](vit-shape-by-shape.md#an-image), [terms](../glossary.md#patch) and "
            "![fig](../figures/fmnist-curves.png).\n\n"
            "```python\nprint(1)\n```\n```output\n1\n```\n\n1. Add one.\n\n/// details | Solution\n"
            "    type: success\n\nAdd it.\n\n```python\nprint(2)\n```\n```output\n2\n```\n///\n\n"
            "2. Why?\n\n/// details | Solution\n    type: success\n\nBecause.\n///\n")
    nb = notebooks.notebook(page, "tutorials/t.md", "https://example.org/docs/", "en")
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert [c.source for c in code] == ["print(1)", notebooks.ANSWER["en"], "print(2)"]
    assert code[0].outputs[0].text == "1\n" and "jupyter" not in code[0].metadata
    assert code[2].metadata["jupyter"] == {"source_hidden": True} and code[2].outputs[0].text == "2\n"
    prose = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    assert "[page 1](vit-shape-by-shape.ipynb)" in prose  # the other tutorial's notebook, beside this one
    assert "[terms](https://example.org/docs/glossary/#patch)" in prose
    assert "attachment:figures-fmnist-curves.png" in prose and "///" not in prose
    assert "<details><summary>Solution</summary>" in prose and "Because." in prose
    ko = notebooks.notebook(page, "tutorials/t.ko.md", "https://example.org/docs/", "ko")
    assert "(vit-shape-by-shape.ko.ipynb)" in "".join(c.source for c in ko.cells)
    assert "https://example.org/docs/ko/glossary/#patch" in "".join(c.source for c in ko.cells)


@pytest.mark.long  # (17-43 s on a 2-core AVX2 EPYC: the default suite is kept under 10 minutes)
def test_a_downloaded_notebook_runs_top_to_bottom(tmp_path: Path) -> None:
    """The notebook of page 1, away from the site, in a Jupyter kernel (nbclient): every cell runs, the reader's
    empty answer cell included, and its figures travel inside it."""
    import nbclient
    import nbformat
    import notebooks  # docs/hooks/notebooks.py

    md = ROOT / "docs" / "tutorials" / "vit-shape-by-shape.md"
    nb = notebooks.notebook(md.read_text(), "tutorials/vit-shape-by-shape.md", "https://example.org/", "en")
    attached = {name for c in nb.cells if c.cell_type == "markdown" for name in c.get("attachments", {})}
    assert "figures-posemb-sincos.png" in attached  # a committed figure: embedded
    drawn = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    assert "](https://example.org/figures/patch-grid.png)" in drawn  # one drawn at the build: on the site
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}},
                            ).execute()
    printed = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "image (1, 3, 224, 224) patches 196" in printed and "(1, 577, 1024)" in printed
    assert (tmp_path / "posemb-sincos.png").is_file()
    assert not [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    nbformat.validate(nb)


def test_csv_pivot_gives_one_column_per_cpu_kind(tmp_path: Path) -> None:
    import results as hooks  # docs/hooks/results.py

    f = tmp_path / "r.csv"
    f.write_text("task,cpu_kind,top1\nfmnist 5 min,amx,92.1\nfmnist 5 min,amx,92.2\nfmnist 5 min,avx2,88.0\n"
                 "cifar,avx2,76.3\n")
    table = hooks.csv_pivot(str(f), "task", "cpu_kind", "top1", "r.csv").split("\n\n")[0]
    assert table.splitlines() == ["| task | amx | avx2 |", "|---|---|---|", "| fmnist 5 min | 92.1; 92.2 | 88.0 |",
                                  "| cifar | – | 76.3 |"]
    with pytest.raises(ValueError, match=r"r.csv: no column\(s\) \['cpu'\]"):
        hooks.csv_pivot(str(f), "task", "cpu", "top1", "r.csv")


def test_every_results_row_has_its_headers_columns() -> None:
    """A row appended by hand with another column order, or a cell with an unquoted comma, reads as a table that
    says something else (a note under 'chosen', a model's name split across 'batch' and 'precision')."""
    numeric = re.compile(r"^-?[0-9.]+(e-?[0-9]+)?$")
    for path in sorted((ROOT / "results").rglob("*.csv")):
        with path.open(newline="") as f:
            header, *rows = list(csv.reader(f))
        for i, row in enumerate(rows, start=2):
            assert len(row) == len(header), f"{path.name} line {i}: {len(row)} cells, header has {len(header)}"
            cells = dict(zip(header, row))
            if cells.get("chosen"):
                assert isinstance(json.loads(cells["chosen"]), dict), f"{path.name} line {i}: chosen"
            for k in ("planning_s", "wall_s", "val_top1", "steps", "ms_per_step", "img_per_s"):
                assert not cells.get(k) or numeric.match(cells[k]), f"{path.name} line {i}: {k}={cells[k]!r}"


def test_a_korean_page_shows_its_tables_in_korean(tmp_path: Path) -> None:
    import results as hooks  # docs/hooks/results.py

    f = tmp_path / "r.csv"
    f.write_text("cpu,val_top1,note\n\"Intel Xeon, AMX + AVX512-BF16 (2 cores)\",91.2,nothing else running\n")
    table = hooks.csv_table(str(f), None, "r.csv", ko=True)
    assert table.splitlines()[:3] == ["| CPU | 검증 top-1 | 메모 |", "|---|---|---|",
                                      "| Intel Xeon, AMX + AVX512-BF16 (코어 2개) | 91.2 | 다른 작업 없음 |"]
    assert "출처: [`" in table and "From" not in table
    assert hooks.csv_table(str(f), None, "r.csv").startswith("| cpu | val_top1 | note |")  # English stays
    f.write_text("cpu,val_top1,note\nx,1,a sentence nobody translated\n")
    with pytest.raises(hooks.Untranslated, match="column 'note', cell 'a sentence nobody translated'"):
        hooks.csv_table(str(f), None, "r.csv", ko=True)
    f.write_text("run,unheard_of\nlearn-seed0,1\n")  # a run name is typed, not translated; a new column needs a name
    with pytest.raises(hooks.Untranslated, match="column 'unheard_of': no Korean name"):
        hooks.csv_table(str(f), None, "r.csv", ko=True)
    for page in (ROOT / "docs").rglob("*.ko.md"):  # every Korean page's tables are translated and what their CSVs hold
        assert hooks.write_tables(page.read_text(), page) == page.read_text(), page


# python tests/test_docs.py PAGE.md [DIR]: run one page in DIR (a new temporary folder by default; the figures it
# draws land there) and say where it, or a translation of it, does not show what it printed; with --update, write
# that into them (--update --refresh: the numbers of the output-varies blocks too).
if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a not in ("--update", "--refresh")]
    target = Path(args[0]).resolve()
    folder = Path(args[1]).resolve() if len(args) > 1 else Path(tempfile.mkdtemp(prefix="vitkit-page-"))
    link_shared_data(target, folder)
    if target.name in HUB_WEIGHTS:
        hub_stand_in(target, folder)
    started = time.monotonic()
    out = run_page(target, folder)
    if "--update" in sys.argv:
        for p in (target, *translations(target)):
            print(f"{p.name}: {update_page(p, out, '--refresh' in sys.argv)} output block(s) written (ran in {folder})")
        if "--refresh" in sys.argv:  # the numbers now on the page are this machine's: say which machine, and when
            record_printed_on(target, time.monotonic() - started)
    else:
        problems = [m for p in (target, *translations(target)) for m in mismatches(p, out)]
        print("\n\n".join(problems) or f"{target.name}: shows what it prints (ran in {folder})")
        sys.exit(1 if problems else 0)
