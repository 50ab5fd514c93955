"""The front page stays short and every relative link of the documentation resolves.

README.md is the first page a newcomer reads: at most :data:`README_MAX_LINES` lines, the
rest lives in ``docs/``. Every relative link in README.md and ``docs/*.md`` must name an
existing file or folder, and a ``#anchor`` must name a heading of the target (GitHub's
slugs: lower case, punctuation dropped, spaces to hyphens, ``-1``, ``-2`` for repeats).
Links inside code (fenced blocks, backticks) are not links and are not checked.
"""

import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README_MAX_LINES = 250

_FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.S | re.M)
_INLINE_CODE = re.compile(r"(`+)(?!`)(?:(?!\n[ \t]*\n).)*?(?<!`)\1(?!`)", re.S)  # in a paragraph
_INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]"           # [text], nested [] once
                          r"\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")  # (target "title")
_REF_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s.*)?$", re.M)
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$", re.M)
_HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.I)


def documentation_files() -> list:
    return [os.path.join(ROOT, "README.md"),
            *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]


def _without_code(text: str) -> str:
    """The text with fenced code blocks and inline code spans blanked out (the line
    structure is kept, so that reported line numbers stay right)."""
    def blank(match):
        return re.sub(r"[^\n]", " ", match.group(0))

    return _INLINE_CODE.sub(blank, _FENCE.sub(blank, text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)   # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = "".join(c for c in text if c.isalnum() or c in "-_ ")
    return text.replace(" ", "-")


def anchors(path: str) -> set:
    """Every anchor of a Markdown file: its headings' slugs (repeats numbered as GitHub
    does) and explicit ``<a name=...>`` / ``<a id=...>``."""
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    plain = _FENCE.sub("", text)
    found, seen = set(_HTML_ANCHOR.findall(text)), {}
    for _, heading in _HEADING.findall(plain):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(path: str) -> list:
    """``(line, target)`` of every link (inline, image, reference definition)."""
    with open(path, encoding="utf-8") as fh:
        text = _without_code(fh.read())
    found = sorted((match.start(), match.group(1)) for pattern in (_INLINE_LINK, _REF_DEF)
                   for match in pattern.finditer(text))
    return [(text.count("\n", 0, start) + 1, target) for start, target in found]


def broken_links(path: str, root: str = ROOT) -> list:
    """``"file:line: target: why"`` for every relative link of ``path`` that does not
    resolve (names relative to ``root``)."""
    bad = []
    name = os.path.relpath(path, root)
    for line, target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):   # http:, https:, mailto:, ...
            continue
        file_part, _, anchor = target.partition("#")
        resolved = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) \
            if file_part else path
        where = f"{name}:{line}: {target}"
        if not os.path.exists(resolved):
            bad.append(f"{where}: no such file or folder")
        elif anchor and resolved.endswith(".md") and anchor not in anchors(resolved):
            bad.append(f"{where}: no heading with that anchor in "
                       f"{os.path.relpath(resolved, root)}")
    return bad


def test_readme_is_short():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
        lines = fh.read().splitlines()
    assert len(lines) <= README_MAX_LINES, \
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move a topic to docs/"


def test_every_relative_link_resolves():
    files = documentation_files()
    assert len(files) > 1   # README.md and docs/
    checked = sum(len(links(path)) for path in files)
    assert checked > 20     # the parser does find the links
    bad = [b for path in files for b in broken_links(path)]
    assert bad == [], "\n".join(bad)


def test_the_check_finds_broken_links_and_anchors(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text(
        "# A page: the `--edgc-mode` flag (1·2)\n\n## Twice\n\n## Twice\n\n"
        "```\n# not a heading\n[in code](missing.md)\n```\n")
    (tmp_path / "README.md").write_text(
        "Good: [a](docs/a.md), [anchor](docs/a.md#a-page-the---edgc-mode-flag-12),\n"
        "[repeat](docs/a.md#twice-1), [folder](docs/), [web](https://example.com/x),\n"
        "`[code](nowhere.md)`, [a link over\ntwo lines](docs/a.md#twice).\n"
        "Bad: [missing](docs/b.md), [no anchor](docs/a.md#nope),\n"
        "[code heading](docs/a.md#not-a-heading), [self](#missing-here).\n\n"
        "[ref]: docs/c.md\n")
    assert slug("The loss–bytes plane: adaptive against static") == \
        "the-lossbytes-plane-adaptive-against-static"
    assert broken_links(str(tmp_path / "README.md"), str(tmp_path)) == [
        "README.md:5: docs/b.md: no such file or folder",
        "README.md:5: docs/a.md#nope: no heading with that anchor in docs/a.md",
        "README.md:6: docs/a.md#not-a-heading: no heading with that anchor in docs/a.md",
        "README.md:6: #missing-here: no heading with that anchor in README.md",
        "README.md:8: docs/c.md: no such file or folder"]
    assert broken_links(str(tmp_path / "docs" / "a.md"), str(tmp_path)) == []
