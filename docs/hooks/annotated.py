"""MkDocs hook: ``reference/annotated-vit.md``, the model's source beside the paper, made from
``src/vitkit/model/vit.py`` at every build so that it cannot drift from the code.

Each top-level class and function of the file is a section: its docstring and the equations of the paper it cites
(Eq. 1-4, Appendix A's MSA), typeset, then its code, docstrings left out (they are above it).
"""
from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

from mkdocs.plugins import event_priority
from pages import generated_file

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "src" / "vitkit" / "model" / "vit.py"
PAGE = "reference/annotated-vit.md"
EQUATIONS = {
    "1": r"z_0 = [x_\text{class};\, x_p^1 E;\, x_p^2 E;\, \dots;\, x_p^N E] + E_\text{pos}",
    "2": r"z'_\ell = \text{MSA}(\text{LN}(z_{\ell-1})) + z_{\ell-1}, \qquad \ell = 1 \dots L",
    "3": r"z_\ell = \text{MLP}(\text{LN}(z'_\ell)) + z'_\ell, \qquad \ell = 1 \dots L",
    "4": r"y = \text{LN}(z_L^0)",
    "A": r"\begin{aligned} [q, k, v] &= z\,U_{qkv}, & A &= \text{softmax}\big(q k^\top / \sqrt{D_h}\big), \\"
         r"\text{SA}(z) &= A v, & \text{MSA}(z) &= [\text{SA}_1(z); \dots; \text{SA}_k(z)]\, U_{msa} \end{aligned}",
}
CITES = re.compile(r"Eq\. (\d)(?:\s*-\s*(\d))?|Appendix (A)\b")


@event_priority(-200)  # after mkdocs-static-i18n, which takes no page from outside docs/
def on_files(files, config):  # type: ignore[no-untyped-def]
    f = generated_file(config, PAGE, page())
    i18n = config.plugins.get("i18n")
    if i18n is not None and i18n.current_language != i18n.default_language:  # the English page in each edition
        f.dest_uri = f"{i18n.current_language}/{f.dest_uri}"
    files.append(f)
    return files


def cited(text: str) -> list[str]:
    """The equations ``text`` cites, in order, once each: "Eq. 2-3" -> ["2", "3"]; "Appendix A" -> ["A"]."""
    out: list[str] = []
    for m in CITES.finditer(text):
        keys = [m[3]] if m[3] else [str(i) for i in range(int(m[1]), int(m[2] or m[1]) + 1)]
        out += [k for k in keys if k in EQUATIONS and k not in out]
    return out


def _docstring_lines(node: ast.AST) -> set[int]:
    """The line numbers (1-based) of every docstring inside ``node``."""
    lines: set[int] = set()
    for n in ast.walk(node):
        body = getattr(n, "body", None)
        if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef, ast.Module)) and body and \
                isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) and \
                isinstance(body[0].value.value, str):
            lines.update(range(body[0].lineno, body[0].end_lineno + 1))
    return lines


def _prose(text: str) -> str:
    """A docstring as Markdown: asterisks outside code spans kept literal (``P*P*C`` is no emphasis)."""
    parts = re.split(r"(``.*?``|`.*?`)", inspect.cleandoc(text))
    return "".join(p if p.startswith("`") else p.replace("*", r"\*") for p in parts)


def sections(source: str) -> list[tuple[str, str, str]]:
    """(heading, prose, code) for the file's preamble and each top-level class and function, in file order; the
    module-level names between two definitions go with the one after them."""
    tree = ast.parse(source)
    lines = source.splitlines()
    skip = _docstring_lines(tree)

    def code(a: int, b: int) -> str:  # lines [a, b), 0-based, without docstrings
        return "\n".join(lines[i] for i in range(a, b) if i + 1 not in skip).strip("\n")

    defs = [n for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))]
    first = min([defs[0].lineno] + [d.lineno for d in defs[0].decorator_list]) - 1
    out = [("The module", _prose(ast.get_docstring(tree) or ""), code(0, first))]
    start = first
    for node in defs:
        end = node.end_lineno if node is not defs[-1] else len(lines)
        prose = _prose(ast.get_docstring(node) or "")
        methods = [m for m in node.body if isinstance(m, ast.FunctionDef) and ast.get_docstring(m)]
        prose += "".join(f"\n\n`{m.name}`: {_prose(ast.get_docstring(m))}" for m in methods)
        kind = "class" if isinstance(node, ast.ClassDef) else "def"
        out.append((f"`{kind} {node.name}`", prose, code(start, end)))
        start = end
    return out


def page(source: str | None = None) -> str:
    source = source if source is not None else SOURCE.read_text()
    parts = ["# The model, annotated\n",
             "The whole of `src/vitkit/model/vit.py` beside the paper: for each piece, what it is and the equations "
             "it implements, then its code. This page is made from the file at every build of the site, so it is "
             "always the code that runs. The [shape-by-shape tutorial](../tutorials/vit-shape-by-shape.md) checks "
             "each equation against it.\n"]
    for heading, prose, code in sections(source):
        math = "".join(f"\n$$\n{EQUATIONS[k]} \\tag{{{k if k != 'A' else 'App. A'}}}\n$$\n"
                       for k in cited(prose + code))
        parts.append(f"## {heading}\n\n<div class=\"annotated\" markdown>\n<div class=\"note\" markdown>\n\n"
                     f"{prose}\n{math}\n</div>\n<div class=\"code\" markdown>\n\n```python\n{code}\n```\n\n"
                     "</div>\n</div>\n")
    return "\n".join(parts)
