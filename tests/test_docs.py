"""The README is a manual (issue 46): short, and every page of docs/ is linked from it; every relative link in
the README and docs/ leads to a file that exists."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_the_readme_is_short_and_links_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    linked = {Path(target).name for target in LINK.findall(readme) if target.startswith("docs/")}
    assert {page.name for page in (ROOT / "docs").glob("*.md")} <= linked


def test_every_relative_link_leads_somewhere():
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in LINK.findall(page.read_text()):
            if "://" not in target:
                assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"
