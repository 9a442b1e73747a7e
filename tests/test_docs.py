"""The design the code points to is in the repository: every section a docstring names exists."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import ROOT

DESIGN = ROOT / "docs" / "design.md"
FOLDERS = ("core", "solvers", "plan", "runtime", "cli", "benchmarks", "examples", "tests")
# docs/design.md, "Semantics" / docs/design.md "Memory holds" / docs/design.md,\n"The problem file"
REFERENCE = re.compile(r'docs/design\.md,?\s+"([^"]+)"')


def _sources() -> list[Path]:
    return [path for folder in FOLDERS for path in sorted((ROOT / folder).rglob("*.py"))
            if path != Path(__file__).resolve()]


def _headings() -> set[str]:
    return {line.lstrip("#").strip() for line in DESIGN.read_text().splitlines() if line.startswith("#")}


def test_every_section_the_code_names_is_a_heading_of_the_design():
    named = {section: path.relative_to(ROOT) for path in _sources() for section in REFERENCE.findall(path.read_text())}
    assert {"Semantics", "Memory holds", "The problem file"} <= set(named)
    missing = {section: str(path) for section, path in named.items() if section not in _headings()}
    assert not missing, f"named in the code but not a heading of docs/design.md: {missing}"


def test_no_reference_to_a_design_file_outside_the_repository():
    stale = [str(path.relative_to(ROOT)) for path in _sources() if "DESIGN.md" in path.read_text()]
    assert not stale


def test_the_readme_links_the_design():
    assert "[docs/design.md](docs/design.md)" in (ROOT / "README.md").read_text()
