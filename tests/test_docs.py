"""The documentation: README.md (the front door) and the MkDocs site under docs/.

The site is built with ``mkdocs build --strict`` (mkdocs.yml turns unrecognised links, absolute links, missing
anchors and pages left out of the navigation into warnings, which strict mode makes failures); every relative link
of README.md and docs/ must name a file that exists, and a link into a page with ``#anchor`` a heading of that
page; every page is in the navigation and every navigation entry is a page. Each check is also shown to fail on a
small synthetic broken case, so a check that silently passes everything is caught.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import unicodedata
from pathlib import Path
from urllib.parse import unquote

import pytest
from clitools import HANG

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
MKDOCS_YML = ROOT / "mkdocs.yml"
HAVE_MKDOCS = importlib.util.find_spec("mkdocs") is not None
needs_mkdocs = pytest.mark.skipif(not HAVE_MKDOCS, reason="mkdocs is not installed (pip install -e '.[test]')")

_FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"`[^`]*`")  # may run over a line break, as Markdown allows
# `](target)` or `](target "title")`: the text before it may hold brackets ("[CLS]") and line breaks (long alt text)
_INLINE_LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE_LINK = re.compile(r"^[ ]{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.MULTILINE)
_HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$", re.MULTILINE)


def _without_code(text: str) -> str:
    """The text with fenced blocks and code spans blanked out: a path written as code is not a link."""
    return _CODE_SPAN.sub("``", _FENCE.sub("", text))


def links(text: str) -> list[str]:
    """Every link and image target of a Markdown text, in order (inline and reference style)."""
    text = _without_code(text)
    return _INLINE_LINK.findall(text) + _REFERENCE_LINK.findall(text)


def slugify(heading: str) -> str:
    """A heading's anchor as MkDocs makes it (Python-Markdown's toc): the text without its Markdown, accents and
    other non-ASCII characters dropped, punctuation dropped, lower case, runs of spaces and hyphens one hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link or image: its text
    text = text.replace("`", "").replace("*", "")
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(text: str) -> set[str]:
    """The anchors of a page's headings; a repeated heading gets _1, _2, ... as in Python-Markdown."""
    seen: set[str] = set()
    for match in _HEADING.finditer(_FENCE.sub("", text)):
        slug = base = slugify(match.group(2))
        n = 0
        while slug in seen:
            n += 1
            slug = f"{base}_{n}"
        seen.add(slug)
    return seen


def broken_links(page: Path) -> list[str]:
    """The relative links of a Markdown file that do not resolve: a missing file, or a missing heading for a
    ``page.md#anchor`` link. Web and mail links and a page's links to its own headings are not checked here
    (MkDocs checks the latter for the site's pages)."""
    problems = []
    for target in links(page.read_text(encoding="utf-8")):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith("#"):
            continue  # http:, https:, mailto:, ... or an anchor of this page
        path, _, anchor = target.partition("#")
        resolved = (page.parent / unquote(path)).resolve()
        if not resolved.exists():
            problems.append(f"{page.name}: {target} -> no file {resolved}")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved.read_text(encoding="utf-8")):
            problems.append(f"{page.name}: {target} -> {resolved.name} has no heading with anchor #{anchor}")
    return problems


def nav_pages(config: Path) -> list[str]:
    """The pages listed under ``nav:`` in an mkdocs.yml (entries ``- Title: page.md`` or ``- page.md``)."""
    text = config.read_text(encoding="utf-8")
    nav = re.search(r"^nav:\s*\n((?:[ \t]+.*\n?|\s*\n)*)", text, re.MULTILINE)
    assert nav, f"{config} has no nav"
    return re.findall(r"^\s*-\s*(?:[^\n]*?:\s+)?['\"]?([^\s'\"]+\.md)['\"]?\s*$", nav.group(1), re.MULTILINE)


def build(config: Path, site_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site_dir), "-f", str(config)],
        capture_output=True, text=True, timeout=HANG, cwd=config.parent,
    )


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


# --- the real documentation ------------------------------------------------------------------------------------


@needs_mkdocs
def test_site_builds_strictly(tmp_path):
    result = build(MKDOCS_YML, tmp_path / "site")
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stderr}"
    assert (tmp_path / "site" / "index.html").exists()


def test_every_relative_link_resolves():
    problems = [problem for page in markdown_files() for problem in broken_links(page)]
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_readme_links_into_the_docs():
    targets = {target.partition("#")[0] for target in links((ROOT / "README.md").read_text(encoding="utf-8"))}
    pages = {f"docs/{page}" for page in nav_pages(MKDOCS_YML)}
    assert pages <= targets, f"README.md does not link to {sorted(pages - targets)}"


def test_every_page_is_in_the_nav_and_every_entry_is_a_page():
    nav = nav_pages(MKDOCS_YML)
    pages = sorted(str(page.relative_to(DOCS)) for page in DOCS.rglob("*.md"))
    assert sorted(set(nav)) == sorted(nav), f"a page is listed twice in the nav: {nav}"
    assert [p for p in pages if p not in nav] == [], "pages missing from mkdocs.yml's nav"
    assert [p for p in nav if p not in pages] == [], "nav entries without a page under docs/"


def test_every_image_is_shown_somewhere():
    shown = {
        (page.parent / unquote(target.partition("#")[0])).resolve()
        for page in markdown_files()
        for target in links(page.read_text(encoding="utf-8"))
    }
    images = sorted((DOCS / "img").iterdir())
    unused = [str(image.relative_to(ROOT)) for image in images if image.resolve() not in shown]
    assert not unused, f"images under docs/img that no page shows: {unused}"


@pytest.mark.skipif(importlib.util.find_spec("markdown") is None, reason="Python-Markdown is not installed")
def test_anchors_are_those_mkdocs_makes():
    import markdown

    for page in sorted(DOCS.rglob("*.md")):
        md = markdown.Markdown(extensions=["toc", "tables", "fenced_code"])
        md.convert(page.read_text(encoding="utf-8"))

        def ids(tokens):
            for token in tokens:
                yield token["id"]
                yield from ids(token["children"])

        assert anchors(page.read_text(encoding="utf-8")) == set(ids(md.toc_tokens)), page.name


# --- each check can fail -----------------------------------------------------------------------------------------


def test_link_checker_finds_broken_links(tmp_path):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(b"")
    (tmp_path / "other.md").write_text("# Other page\n\n## Results: de→en (beam 4)\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n"
        "[fine](other.md) [fine](other.md#results-deen-beam-4) ![fine [CLS]\nover two lines](img/a.png)\n"
        "[web](https://example.org/missing.md) [mail](mailto:a@b.c) [own heading](#page)\n"
        "`[in code](missing-in-code.md)`\n\n```\n[in a fence](missing-in-fence.md)\n```\n\n"
        "[gone](missing.md) ![gone](img/b.png) [no such heading](other.md#nothing)\n\n"
        "[ref]: missing-reference.md\n",
        encoding="utf-8",
    )
    problems = broken_links(page)
    assert len(problems) == 4, problems
    for target in ("missing.md", "img/b.png", "other.md#nothing", "missing-reference.md"):
        assert any(f": {target} ->" in problem for problem in problems), (target, problems)


def test_nav_reader_reads_entries(tmp_path):
    config = tmp_path / "mkdocs.yml"
    config.write_text("site_name: t\nnav:\n  - Home: index.md\n  - 'Two: parts': sub/two.md\n  - three.md\n"
                      "theme:\n  name: mkdocs\n", encoding="utf-8")
    assert nav_pages(config) == ["index.md", "sub/two.md", "three.md"]


@needs_mkdocs
def test_strict_build_fails_on_a_broken_link(tmp_path):
    (tmp_path / "docs").mkdir()
    config = tmp_path / "mkdocs.yml"
    config.write_text(MKDOCS_YML.read_text(encoding="utf-8").split("\nnav:")[0] + "\nnav:\n  - Home: index.md\n",
                      encoding="utf-8")
    index = tmp_path / "docs" / "index.md"
    index.write_text("# Home\n\n## Part\n\n[a heading](#part)\n", encoding="utf-8")
    result = build(config, tmp_path / "site")
    assert result.returncode == 0, f"the synthetic site should build:\n{result.stderr}"

    for broken in ("[a page](missing.md)", "[an anchor](#nowhere)", "[outside docs](../mkdocs.yml)"):
        index.write_text(f"# Home\n\n{broken}\n", encoding="utf-8")
        result = build(config, tmp_path / "site")
        assert result.returncode != 0, f"mkdocs build --strict passed a site with {broken}"

    index.write_text("# Home\n", encoding="utf-8")
    (tmp_path / "docs" / "orphan.md").write_text("# Not in the nav\n", encoding="utf-8")
    result = build(config, tmp_path / "site")
    assert result.returncode != 0, "mkdocs build --strict passed a page missing from the nav"


def test_the_python_pages_examples_run_as_written():
    """docs/python.md says every line runs as written: its blocks run in order, in one namespace."""
    blocks = re.findall(r"^```python\n(.*?)^```", (DOCS / "python.md").read_text(encoding="utf-8"), re.S | re.M)
    assert len(blocks) >= 2
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "docs/python.md", "exec"), namespace)  # the project's own page
    assert namespace["first"].finish == "length" and len(namespace["second"].tokens) == 5
