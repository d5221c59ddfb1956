"""The README opens with the two commands (set up + train, set up + test) and .ci/run runs the second."""

from __future__ import annotations

from tests.helpers import REPO


def test_readme_opens_with_the_two_commands():
    text = (REPO / "README.md").read_text()
    blocks = text.split("```")
    first = [
        line
        for line in blocks[1].strip().splitlines()
        if line and not line.startswith("#") and not line.startswith("bash")
    ]
    assert len(first) == 2
    assert first[0].rstrip().endswith("train.py")
    assert "pytest" in first[1]
    ci = (REPO / ".ci" / "run").read_text()
    assert first[1].strip() in ci
