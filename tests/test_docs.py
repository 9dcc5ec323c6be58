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


def test_the_demos_length_is_given_one_way():
    """The README's table holds the measured time of each demo (the quick one on each kind of CPU: bfloat16 in
    hardware, AVX2 only); every other place that says how long a demo takes (the set-up line, `demo --help`, the
    module, docs/demo.md) says the same, rounded to minutes, and gives the quick demo's time on both kinds."""
    readme = (ROOT / "README.md").read_text()
    measured = {}
    for flag, key in (("", "quick"), (" --full", "full")):
        row = re.search(rf"^\| `flashdraft demo{flag}` \|.*$", readme, re.M).group(0)
        measured[key] = {round(int(m) + int(s) / 60) for m, s in re.findall(r"\*\*(\d+) min (\d+) s\*\*", row)}
    assert len(measured["quick"]) == 2 and len(measured["full"]) == 1  # two kinds of CPU, one full demo
    places = {"README.md set-up": readme.split("## The demo")[0],
              "flashdraft/cli/pipeline.py (demo --help)": (ROOT / "flashdraft/cli/pipeline.py").read_text(),
              "flashdraft/demo.py": (ROOT / "flashdraft/demo.py").read_text(),
              "docs/demo.md": (ROOT / "docs/demo.md").read_text()}
    for where, text in places.items():
        said = {int(n) for n in re.findall(r"about (\d+) min", " ".join(text.split()))}
        assert measured["quick"] <= said <= measured["quick"] | measured["full"], (where, said, measured)


def test_dated_measurements_live_in_results_not_in_the_manual():
    """docs/ says how things work; a figure with its date is a measurement, and belongs in benchmarks/RESULTS.md
    (docs/benchmarks.md, the page about the benchmarks, excepted)."""
    for page in sorted((ROOT / "docs").glob("*.md")):
        if page.name != "benchmarks.md":
            assert not re.search(r"20\d\d-\d\d-\d\d", page.read_text()), f"{page.name} carries a dated measurement"
