"""``python train.py --help`` and ``--cfg job|hydra|all [--resolve]``: what a run would be, printed
without running it.

Hydra answers these flags itself, but its help lists the schema entries every component stores in the
ConfigStore (``mixer: gqa, gqa_schema, ...``) as if they were choices, ``--cfg job --resolve`` fails on
``model.vocab_size: ${data.vocab_size}``, which only the chosen dataset can fill (a prepared folder's
vocabulary, a tokenizer's size), and ``--cfg hydra --resolve`` fails on keys Hydra fills only when a job
runs (``hydra.job.num``) and on the run config's keys the ``hydra`` node refers to (``output_root``). All
are answered here from the same composition and data completion a run uses, the ``hydra`` node resolved
inside the whole config with the values its first job would get. The other information flags
(``--info``, ``--hydra-help``, ``--shell-completion``, ``--version``) stay Hydra's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from runtime.compose import compose, conf_dir, strip_hydra
from runtime.config import REGISTRIES
from runtime.validation import complete_data

HELP_FLAGS = ("--help", "-h")
CFG_FLAGS = ("--cfg", "-c")
PACKAGE_FLAGS = ("--package", "-p")
CFG_CHOICES = ("job", "hydra", "all")


class PreviewFlagError(ValueError):
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


def completed_config(overrides: list[str], multirun: bool = False) -> DictConfig:
    """The composed config (with its ``hydra`` node) and the chosen dataset's own fields filled in; the
    ``hydra`` node's job fields as Hydra sets them for a single run, or for a multirun's first job."""
    cfg = compose(overrides)
    complete_data(cfg)
    with read_write(cfg.hydra), open_dict(cfg.hydra):
        cfg.hydra.job.num = 0
        cfg.hydra.job.id = "0"
        cfg.hydra.runtime.output_dir = "${hydra.sweep.dir}/${hydra.sweep.subdir}" if multirun else "${hydra.run.dir}"
    return cfg


def asks_help(argv: list[str]) -> bool:
    return any(a in HELP_FLAGS for a in argv)


def answers(argv: list[str]) -> bool:
    """Whether this module answers ``argv`` (``--help``, or ``--cfg``)."""
    return asks_help(argv) or _flag_value(argv, CFG_FLAGS)[0]


def print_config(argv: list[str]) -> None:
    """``--cfg job|all [--resolve] [--package KEY]``, as Hydra prints it."""
    _, choice = _flag_value(argv, CFG_FLAGS)
    if choice not in CFG_CHOICES:
        raise PreviewFlagError(f"--cfg: '{choice}' is not allowed; choose one of {', '.join(CFG_CHOICES)}")
    cfg = completed_config(overrides_of(argv), multirun="-m" in argv or "--multirun" in argv)
    resolve = "--resolve" in argv
    if resolve:  # in the whole config, so that the hydra node's references to the run's keys resolve
        OmegaConf.resolve(cfg)
    node = strip_hydra(cfg) if choice == "job" else _hydra_node(cfg) if choice == "hydra" else cfg
    given, package = _flag_value(argv, PACKAGE_FLAGS)
    if given:
        node = OmegaConf.select(cfg, package or "", default=None)
        if node is None:
            raise PreviewFlagError(f"--package: the config has no key '{package}'")
        print(f"# @package {package}")
    print(OmegaConf.to_yaml(node, resolve=resolve) if isinstance(node, DictConfig) else node)


def _hydra_node(cfg: DictConfig) -> DictConfig:
    """The ``hydra`` node alone, without its help texts (what Hydra's own ``--cfg hydra`` prints)."""
    hydra = OmegaConf.to_container(cfg.hydra)  # resolved already when --resolve is given
    return OmegaConf.create({"hydra": {k: v for k, v in hydra.items() if k not in ("help", "hydra_help")}})


def config_groups(conf: Path) -> dict[str, list[str]]:
    """Each config group under ``conf`` (its YAML files, Hydra's own groups left out) and its options."""
    groups: dict[str, list[str]] = {}
    for path in sorted(conf.rglob("*.yaml")):
        group = path.parent.relative_to(conf).as_posix()
        if group != "." and not group.startswith("hydra"):
            groups.setdefault(group, []).append(path.stem)
    return groups


def print_help(argv: list[str]) -> None:
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
