"""The README's component table is generated from the registries and must match them."""

from __future__ import annotations

from components.catalog import BEGIN, END, readme_block
from tests.conftest import REPO


def test_readme_component_table_is_in_sync():
    text = (REPO / "README.md").read_text()
    assert BEGIN in text and END in text, "README.md lost its component table markers"
    block = text[text.index(BEGIN) : text.index(END) + len(END)]
    assert block == readme_block(), "README table is stale: paste the output of `python -m components.catalog`"


def test_readme_opens_with_the_two_commands():
    text = (REPO / "README.md").read_text()
    blocks = text.split("```")
    first = [line for line in blocks[1].strip().splitlines() if line and not line.startswith("#") and not line.startswith("bash")]
    assert len(first) == 2
    assert first[0].rstrip().endswith("train.py")
    assert "pytest" in first[1]
    ci = (REPO / ".ci" / "run").read_text()
    assert first[1].strip() in ci
