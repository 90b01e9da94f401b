"""The documentation stays true to the tree: links resolve, the layout table names what exists."""
from __future__ import annotations

import glob
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: pathlib.Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def _links(page: pathlib.Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return re.findall(r"\]\(([^)\s]+)\)", text)


def test_relative_links_resolve():
    broken = []
    for page in PAGES:
        for link in _links(page):
            if re.match(r"[a-z]+:", link):  # http:, https:, mailto:
                continue
            path, _, anchor = link.partition("#")
            target = (page.parent / path).resolve() if path else page
            if not target.exists():
                broken.append(f"{page.relative_to(ROOT)}: {link} (no such file)")
            elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
                broken.append(f"{page.relative_to(ROOT)}: {link} (no such heading)")
    assert not broken, "\n".join(broken)


def _layout_rows() -> list[tuple[str, str]]:
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("## Where the code is", 1)[1]
    return re.findall(r"^\| `([^`]+)` \| (.+) \|$", section, flags=re.M)


def test_the_layout_table_names_what_exists():
    rows = _layout_rows()
    assert len(rows) >= 7
    for path, what in rows:
        assert (ROOT / path).exists(), path
        for name in re.findall(r"`([^`]+)`", what):
            if name.startswith(".") or not re.search(r"\.\w+$|/$", name):
                continue  # `.pyi`, a file kind rather than a file
            assert glob.glob(str(ROOT / path / name)), f"{path}{name}"
    named = set(re.findall(r"`([\w-]+\.md)`", dict(rows)["docs/"]))
    assert named == {p.name for p in (ROOT / "docs").glob("*.md")}


def test_every_metric_the_server_exports_is_listed():
    """docs/metrics.md lists each `skippy:` series the code defines, and no other."""
    defined = set()
    for path in (ROOT / "skippy_scheduler").rglob("*.py"):
        defined |= set(re.findall(r"\"(skippy:[a-z_]+)\"", path.read_text(encoding="utf-8")))
    page = (ROOT / "docs" / "metrics.md").read_text(encoding="utf-8")
    listed = {re.sub(r"_total$", "", name) for name in re.findall(r"`(skippy:[a-z_]+)`", page)}
    # A counter is defined by its base name and exported with _total.
    assert defined - listed == set(), "defined but not listed"
    assert listed - defined == set(), "listed but not defined"
