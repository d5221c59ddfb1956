"""``python train.py --help`` and ``--cfg job|all``: what a run would be, printed without running it.

Hydra answers these flags itself, but its help lists the schema entries every component stores in the
ConfigStore (``mixer: gqa, gqa_schema, ...``) as if they were choices, and ``--cfg job --resolve`` fails on
``model.vocab_size: ${data.vocab_size}``, which only the chosen dataset can fill (a prepared folder's
vocabulary, a tokenizer's size). Both are answered here from the same composition and data completion a
run uses; ``--cfg hydra`` and the other information flags stay Hydra's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from omegaconf import DictConfig, OmegaConf

HELP_FLAGS = ("--help", "-h")
CFG_FLAGS = ("--cfg", "-c")
PACKAGE_FLAGS = ("--package", "-p")
CFG_CHOICES = ("job", "hydra", "all")


class InfoFlagError(ValueError):
    """A malformed ``--cfg`` / ``--package`` flag."""


def _flag_value(argv: list[str], names: tuple[str, ...]) -> tuple[bool, Optional[str]]:
    """(whether one of ``names`` is given, its value: the next argument or the part after ``=``)."""
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name in names:
            if eq:
                return True, value
            return True, argv[i + 1] if i + 1 < len(argv) else None
    return False, None


def overrides_of(argv: list[str]) -> list[str]:
    """The config overrides among ``argv`` (flags and the values of ``--cfg`` / ``--package`` dropped)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in CFG_FLAGS + PACKAGE_FLAGS:
            skip = True
            continue
        if not arg.startswith("-"):
            out.append(arg)
    return out


def completed_config(overrides: list[str]) -> DictConfig:
    """The composed config (with its ``hydra`` node) and the chosen dataset's own fields filled in."""
    from runtime.launch import compose
    from runtime.validation import complete_data

    cfg = compose(overrides)
    complete_data(cfg)
    return cfg


def answers(argv: list[str]) -> bool:
    """Whether this module answers ``argv`` (``--help``, or ``--cfg job|all``)."""
    if any(a in HELP_FLAGS for a in argv):
        return True
    given, choice = _flag_value(argv, CFG_FLAGS)
    return given and choice != "hydra"


def print_config(argv: list[str]) -> None:
    """``--cfg job|all [--resolve] [--package KEY]``, as Hydra prints it."""
    _, choice = _flag_value(argv, CFG_FLAGS)
    if choice not in CFG_CHOICES:
        raise InfoFlagError(f"--cfg: '{choice}' is not allowed; choose one of {', '.join(CFG_CHOICES)}")
    cfg = completed_config(overrides_of(argv))
    if choice == "job":
        from runtime.launch import strip_hydra

        cfg = strip_hydra(cfg)
    given, package = _flag_value(argv, PACKAGE_FLAGS)
    node = cfg
    if given:
        node = OmegaConf.select(cfg, package or "", default=None)
        if node is None:
            raise InfoFlagError(f"--package: the config has no key '{package}'")
        print(f"# @package {package}")
    resolve = "--resolve" in argv
    print(OmegaConf.to_yaml(node, resolve=resolve) if isinstance(node, DictConfig) else node)


def config_groups(conf: Path) -> dict[str, list[str]]:
    """Each config group under ``conf`` (its YAML files, Hydra's own groups left out) and its options."""
    groups: dict[str, list[str]] = {}
    for path in sorted(conf.rglob("*.yaml")):
        group = path.parent.relative_to(conf).as_posix()
        if group != "." and not group.startswith("hydra"):
            groups.setdefault(group, []).append(path.stem)
    return groups


def print_help(argv: list[str]) -> None:
    from runtime.config import REGISTRIES
    from runtime.launch import conf_dir, strip_hydra

    lines = [
        "python train.py [group=option ...] [key=value ...]   train one run (-m / --multirun: a sweep)",
        "",
        "Config groups (group=option):",
    ]
    for group, options in config_groups(Path(conf_dir())).items():
        lines.append(f"  {group}: {', '.join(options)}")
        registry = REGISTRIES.get(group)
        for option in options if registry is not None else ():
            if option in registry:
                lines.append(f"      {option:<20} {registry.get(option).summary}")
    lines += [
        "",
        "Any key of the config below can be set (key=value); unknown keys are refused.",
        "--cfg job [--resolve]: print the composed config; --hydra-help: Hydra's own flags.",
        "",
        "== Config ==",
        OmegaConf.to_yaml(strip_hydra(completed_config(overrides_of(argv)))),
    ]
    print("\n".join(lines))
