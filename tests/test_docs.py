"""The documentation site builds without warnings, and every tutorial runs as written.

A tutorial is run top to bottom in a fresh folder: its ```python blocks in one namespace (as a reader pasting
them into one session would), its ```bash blocks in bash with this environment's ``vitkit`` on PATH, in the order
they appear, since the tutorials interleave the command line and Python. Blocks marked ```console are shown,
not run (they need the internet, a GPU or several machines, or run until stopped). pytest-markdown-docs runs only
Python blocks and mktestdocs runs each language apart, which loses that order, so the blocks are read with
markdown-it-py (the CommonMark parser rich uses) and run here.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

ROOT = Path(__file__).resolve().parents[1]
TUTORIALS = sorted((ROOT / "docs" / "tutorials").glob("*.md"))


def fences(page: Path) -> list[tuple[str, str, int]]:
    """(language, code, first line) of every fenced block of ``page``, in order."""
    tokens = MarkdownIt("commonmark").parse(page.read_text())
    return [(t.info.split()[0] if t.info else "", t.content, t.map[0] + 2) for t in tokens if t.type == "fence"]


def run_page(page: Path, cwd: Path) -> None:
    namespace: dict = {"__name__": "__main__"}
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               MPLBACKEND="Agg")
    old = Path.cwd()
    os.chdir(cwd)
    try:
        for lang, code, line in fences(page):
            if lang == "python":
                exec(compile("\n" * (line - 1) + code, str(page), "exec"), namespace)
            elif lang == "bash":
                done = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=cwd, env=env,
                                      capture_output=True, text=True)
                print(done.stdout, done.stderr[-3000:], sep="\n")
                assert done.returncode == 0, (
                    f"{page.name}:{line}: exit {done.returncode}\n{code}\n{done.stderr[-3000:]}")
    finally:
        os.chdir(old)


@pytest.mark.parametrize("page", TUTORIALS, ids=[p.stem for p in TUTORIALS])
def test_tutorial_runs(page: Path, tmp_path: Path) -> None:
    assert fences(page), f"{page.name} has no code"
    run_page(page, tmp_path)


def test_site_builds_strict(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-5000:]
    site = tmp_path / "site"
    assert (site / "reference" / "api" / "index.html").exists()
    page = (site / "tutorials" / "vit-shape-by-shape" / "index.html").read_text()
    assert "javascripts/katex/katex.min.js" in page and "cdn." not in page  # the renderer ships with the site
    _math_renders_offline(site / "tutorials" / "vit-shape-by-shape" / "index.html")


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


def test_csv_pivot_gives_one_column_per_cpu_kind(tmp_path: Path) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("hooks", ROOT / "docs" / "hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    f = tmp_path / "r.csv"
    f.write_text("task,cpu_kind,top1\nfmnist 5 min,amx,92.1\nfmnist 5 min,amx,92.2\nfmnist 5 min,avx2,88.0\n"
                 "cifar,avx2,76.3\n")
    table = hooks.csv_pivot(str(f), "task", "cpu_kind", "top1", "results.md").split("\n\n")[0]
    assert table.splitlines() == ["| task | amx | avx2 |", "|---|---|---|", "| fmnist 5 min | 92.1; 92.2 | 88.0 |",
                                  "| cifar | – | 76.3 |"]
    with pytest.raises(ValueError, match=r"r.csv: no column\(s\) \['cpu'\]"):
        hooks.csv_pivot(str(f), "task", "cpu", "top1", "results.md")


# python tests/test_docs.py PAGE.md DIR: run one page in DIR (the figures it draws land there)
if __name__ == "__main__":
    run_page(Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve())
