"""The table of registered components: ``python -m components.catalog``.

Generated from the registries, so it lists a new component as soon as its module exists; the README
points here instead of keeping a copy that would need editing by hand.
"""

from __future__ import annotations

from components.registry import FAMILIES, discover_all


def component_table() -> str:
    """Markdown table: config group, name, one-line summary, config dataclass, for every member."""
    rows = ["| group | name | what it is | config |", "|---|---|---|---|"]
    for group, registry in FAMILIES.items():
        for entry in registry:
            rows.append(f"| `{group}` | `{entry.name}` | {entry.summary} | `{entry.config_cls.__name__}` |")
    return "\n".join(rows)


if __name__ == "__main__":
    discover_all()
    print(component_table())
