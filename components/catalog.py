"""The table of registered components shown in the README: ``python -m components.catalog``.

A test checks that the README's table equals this output, so the two never drift apart.
"""

from __future__ import annotations

from components.registry import FAMILIES

BEGIN = "<!-- components:begin -->"
END = "<!-- components:end -->"


def component_table() -> str:
    rows = ["| group | name | what it is | config |", "|---|---|---|---|"]
    for group in ("mixer", "ffn", "balancer", "residual", "data"):
        for entry in FAMILIES[group]:
            rows.append(f"| `{group}` | `{entry.name}` | {entry.summary} | `{entry.config_cls.__name__}` |")
    return "\n".join(rows)


def readme_block() -> str:
    return f"{BEGIN}\n{component_table()}\n{END}"


if __name__ == "__main__":
    from components import register_all

    register_all()
    print(readme_block())
