"""Every page a README or docs/ page names by its file name is in the repository.

tests/unit/test_docs_reference.py checks the paths under src/, tests/, benchmarks/ and docs/ and the links;
a page named bare (`DESIGN.md`, `oom.md`) escaped it, and a clone has no DESIGN.md: the project's design
notes live outside the repository.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("doc", DOCS)
def test_every_page_a_page_names_exists(doc):
    text = (ROOT / doc).read_text()
    named = set(re.findall(r"(?<![\w./-])([\w./-]*\w\.md)\b", text))
    here = (ROOT / doc).parent
    missing = [name for name in sorted(named) if not ((ROOT / name).is_file() or (here / name).is_file())]
    assert not missing, f"{doc} names pages a clone does not have: {missing}"
