"""README.md and the documentation site: every relative link and anchor resolves, README stays a front page."""

import re
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """A heading's anchor as mkdocs' ``toc`` extension (and, for these headings, GitHub) writes it."""
    text = unicodedata.normalize("NFKD", re.sub(r"`|\*\*", "", heading)).encode("ascii", "ignore").decode()
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", text).strip().lower())


def prose(path: Path) -> str:
    """The file without its fenced code blocks (a ``# comment`` there is no heading, a ``](x)`` no link)."""
    return re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)


def anchors(path: Path) -> set[str]:
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", prose(path), flags=re.M)}


def links(path: Path) -> list[str]:
    return [t for t in LINK.findall(prose(path)) if not re.match(r"[a-z]+:", t)]


def dead_links(pages: list[Path]) -> list[str]:
    """``page: target (why)`` for each relative link whose file or heading does not exist."""
    dead = []
    for page in pages:
        for target in links(page):
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                dead.append(f"{page.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                dead.append(f"{page.name}: {target} (no such heading)")
    return dead


def test_every_relative_link_and_anchor_resolves():
    dead = dead_links(PAGES)
    assert not dead, "\n".join(dead)
    assert sum(len(links(p)) for p in PAGES) > 50  # the check saw the links (a broken pattern would pass anything)


def test_the_checker_finds_a_dead_link_and_a_dead_anchor(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## A section (with `code`)\n\n[x](page.md#a-section-with-code) [y](#nothing) "
                    "[z](missing.md)\n\n```bash\n# not a heading [w](nowhere.md)\n```\n")
    assert anchors(page) == {"title", "a-section-with-code"}
    assert links(page) == ["page.md#a-section-with-code", "#nothing", "missing.md"]
    assert dead_links([page]) == ["page.md: #nothing (no such heading)", "page.md: missing.md (no such file)"]


def test_readme_is_a_front_page_with_both_set_up_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    assert re.search(r"^python -m pip install -e \. && ", text, flags=re.M)  # .ci/run reads both from README
    assert re.search(r'^python -m pip install -e "\.\[test\]" && ', text, flags=re.M)
    nav = re.findall(r"^  - [^:]+: (\S+\.md)$", (ROOT / "mkdocs.yml").read_text(), flags=re.M)
    assert sorted(nav) == sorted(p.name for p in PAGES[2:])  # every page is in the site's navigation
