"""The README and the pages under docs/ stay true: links and paths exist, and every training command
line they show still composes (no renamed group, option or key)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from runtime.compose import compose
from tests.helpers import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# repository paths named in text: `components/mixers/kda.py`, `conf/trainer/cpu.yaml`, `docs/k3.md`, ...
PATH = re.compile(r"`((?:components|runtime|analysis|sweeps|benchmarks|tests|conf|docs)/[\w./-]*\w)(?:::\w+)?`")
LINK = re.compile(r"\]\(([^)#\s]+)\)")
COMMAND = re.compile(r"^(?:python train\.py|python -m analysis\.model_report|torchrun [^ ]* ?train\.py)(.*)$")
# commands that name what the reader writes first (the component of "Adding a component")
EXAMPLES = {("mixer=causal_shift",)}
INLINE_COMMAND = re.compile(r"`(python train\.py[^`]*)`")


def _code_lines(text: str) -> list[str]:
    """Lines of the code blocks (a line ending in a backslash joined with the next), then the commands
    quoted inline in the prose."""
    lines, inside, prose = [], False, []
    for line in text.splitlines():
        if line.startswith("```"):
            inside = not inside
        elif inside:
            if lines and lines[-1].endswith("\\"):
                lines[-1] = lines[-1][:-1] + " " + line.strip()
            else:
                lines.append(line)
        else:
            prose.append(line)
    return lines + INLINE_COMMAND.findall(" ".join(prose))


def _commands() -> list[tuple[str, list[str]]]:
    """(page name, overrides) of every ``python train.py`` / ``model_report`` line in a code block."""
    found: dict[tuple[str, ...], str] = {}
    for page in PAGES:
        for line in _code_lines(page.read_text()):
            m = COMMAND.match(line.split("  #")[0].strip())
            if not m:
                continue
            args = [a for a in shlex.split(m.group(1).rstrip("\\ ")) if not a.startswith("-")]
            # a sweep's first job stands for it
            args = [a.split(",")[0] if "," in a and "[" not in a and "{" not in a else a for a in args]
            overrides = tuple(a for a in args if "=" in a)
            if overrides not in EXAMPLES and not any("<" in a for a in overrides):  # <...>: a placeholder
                found.setdefault(overrides, page.name)
    return [(page, list(args)) for args, page in found.items()]


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_links_and_paths_exist(page: Path):
    text = page.read_text()
    missing = [p for p in PATH.findall(text) if not (REPO / p).exists() and "<" not in p]
    missing += [link for link in LINK.findall(text) if "://" not in link and not (page.parent / link).exists()]
    assert not missing, f"{page.name} names what does not exist: {missing}"


def test_every_page_is_linked_from_the_readme():
    readme = (REPO / "README.md").read_text()
    unlinked = [p.name for p in PAGES[1:] if f"(docs/{p.name})" not in readme]
    assert not unlinked


def test_every_training_command_shown_composes():
    failures = []
    for page, overrides in _commands():
        try:
            compose(overrides)
        except Exception as err:  # a ConfigError naming the key
            failures.append(f"{page}: {' '.join(overrides)}: {err}")
    assert not failures, "\n".join(failures)
