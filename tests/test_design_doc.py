"""Citations of the design document resolve: the page exists in the repository, every
`docs/design.md, "Section"` quoted in code names a heading or bold term on it, and nothing cites
the old out-of-tree DESIGN.md any more."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CITING = [*ROOT.glob("hybridmem/**/*.py"), *ROOT.glob("tests/*.py"),
          *ROOT.glob("experiments/*.py"), *ROOT.glob("docs/*.md"), ROOT / "README.md"]


def _sections() -> set[str]:
    text = (ROOT / "docs" / "design.md").read_text()
    heads = re.findall(r"^#+ (.+)$", text, re.M)
    return {h.strip() for h in heads} | set(re.findall(r"\*\*(.+?)\*\*", text))


def test_no_citation_of_the_out_of_tree_design_file():
    here = Path(__file__).name
    bad = [p.name for p in CITING if p.name not in ("design.md", here)
           and re.search(r"(?<!docs/)\bDESIGN\.md", p.read_text())]
    assert bad == []


def test_every_quoted_section_exists():
    sections = _sections()
    quoted = {m for p in CITING if p.name != Path(__file__).name for m in
              re.findall(r'docs/design\.md, "([^"]+)"', " ".join(p.read_text().split()))}
    assert quoted, "no section citations found: the pattern is stale"
    missing = [q for q in quoted if not any(s.startswith(q) for s in sections)]
    assert missing == []
