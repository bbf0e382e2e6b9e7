"""MkDocs hook: in the Korean edition, a page that has no Korean translation yet says so at its top (the i18n
plugin shows the English page in its place), so a reader knows the page is not missing, only untranslated."""
from __future__ import annotations

NOTICE = '!!! note "이 페이지는 아직 영어입니다"\n    한국어 번역이 아직 없어 영어 원문을 보여 드립니다. 용어는 [용어집]({glossary})을 보세요.\n\n'


def on_page_markdown(markdown, page, config, files):  # type: ignore[no-untyped-def]
    if config["theme"].get("language") != "ko" or page.file.src_uri.endswith(".ko.md"):
        return markdown
    if page.file.src_uri.startswith("reference/api"):  # the API reference is the docstrings': English by nature
        return markdown
    depth = page.file.src_uri.count("/")
    glossary = "../" * depth + "glossary.md"
    title, sep, rest = markdown.partition("\n")
    return f"{title}{sep}\n{NOTICE.format(glossary=glossary)}{rest}" if title.startswith("# ") else \
        NOTICE.format(glossary=glossary) + markdown
