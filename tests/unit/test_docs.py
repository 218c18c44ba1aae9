"""README and docs/ link only to files of this repository that exist, and docs/ has the pages a new user needs."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# pages written by work in progress elsewhere; a link to them may dangle until that work is merged
PENDING = {"docs/sglang-contract.md"}
PAGES = ("quickstart", "concepts", "monitoring", "configuration", "customization", "checkpoints", "gpu",
         "troubleshooting")  # fmt: skip
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _documents() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_docs_have_the_pages_and_the_index_links_them():
    index = (REPO / "docs" / "README.md").read_text()
    for page in PAGES:
        assert (REPO / "docs" / f"{page}.md").is_file(), page
        assert f"({page}.md)" in index, page
    readme = (REPO / "README.md").read_text()
    assert "(docs/README.md)" in readme and "(LICENSE)" in readme


def test_links_point_into_the_repository_and_exist():
    for doc in _documents():
        for target in _LINK.findall(doc.read_text()):
            if target.startswith(("http://", "https://", "mailto:", "#")):
                continue
            path = (doc.parent / target.split("#", 1)[0]).resolve()
            rel = path.relative_to(REPO) if path.is_relative_to(REPO) else None
            assert rel is not None, f"{doc.name}: {target} points outside the repository"
            assert path.exists() or rel.as_posix() in PENDING, f"{doc.name}: {target} does not exist"


def test_license_matches_pyproject():
    assert 'license = { text = "Apache-2.0" }' in (REPO / "pyproject.toml").read_text()
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
