"""Command-line entry: validate every job's config before Hydra creates anything, then run Hydra.

``python train.py [overrides]`` composes the config exactly as Hydra will (same search path, same
overrides; for ``-m`` every job of the sweep) and validates it. Any problem -- an unknown component, an
unknown key (including ``+key=`` typos, which Hydra would silently add), a wrong type, impossible
shapes, a missing data file -- prints one message naming the full key and exits with status 2 before a
single folder is created. For single runs it also pins the run folder (``hydra.run.dir``): derived from
the run's name and config, so that the same command with ``ckpt_path=last`` finds the run to resume.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import sys
from pathlib import Path
from typing import Any, Callable, Optional

from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from components.registry import ConfigError, unknown_choice_message
from runtime import handoff, info_flags
from runtime.config import REGISTRIES
from runtime.launch_env import agreed_run_dir
from runtime.memory_check import check_fits
from runtime.sweep_job import split_override

# flags that only print information: no pre-validation, Hydra handles them
INFO_FLAGS = {"--help", "-h", "--hydra-help", "--info", "-i", "--cfg", "-c", "--shell-completion", "-sc", "--version"}
MAX_VALIDATED_JOBS = 512
EXIT_CONFIG_ERROR = 2


def conf_dir() -> str:
    return str(Path(__file__).resolve().parent.parent / "conf")


# ------------------------------------------------------------------------------------------------
# Composition with readable errors
# ------------------------------------------------------------------------------------------------
def _find_omegaconf_error(err: BaseException) -> Optional[OmegaConfBaseException]:
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OmegaConfBaseException):
            return err
        err = err.__cause__ or err.__context__
    return None


def translate_compose_error(err: Exception) -> ConfigError:
    from hydra.errors import MissingConfigException

    if isinstance(err, MissingConfigException):
        missing = err.missing_cfg_file or ""
        group, _, option = missing.rpartition("/")
        if group in REGISTRIES:
            return ConfigError(
                group, unknown_choice_message(REGISTRIES[group].family, option, REGISTRIES[group].names())
            )
        if group:
            options = sorted(o for o in (err.options or []) if not o.endswith("_schema"))
            return ConfigError(group, unknown_choice_message(f"'{group}' option", option, options, listing="Available"))
        return ConfigError("", str(err).strip().splitlines()[0])
    inner = _find_omegaconf_error(err)
    if inner is not None:
        key = getattr(inner, "full_key", "") or ""
        msg = str(getattr(inner, "msg", inner)).strip().splitlines()[0]
        return ConfigError(key, msg)
    text = str(err).strip()
    return ConfigError("", text.splitlines()[0] if text else type(err).__name__)


def compose(overrides: list[str], config_name: str = "config") -> DictConfig:
    """Compose the config (with its ``hydra`` node) as ``train.py`` would; raises ConfigError."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from runtime import register_all

    register_all()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=conf_dir(), version_base=None):
            return hydra_compose(config_name=config_name, overrides=overrides, return_hydra_config=True)
    except ConfigError:
        raise
    except Exception as err:  # Hydra wraps omegaconf errors in several exception types
        raise translate_compose_error(err) from None
    finally:
        GlobalHydra.instance().clear()


def strip_hydra(cfg: DictConfig) -> DictConfig:
    cfg = cfg.copy()
    with open_dict(cfg):
        cfg.pop("hydra", None)
    return cfg


def validate_overrides(overrides: list[str]) -> Any:
    """Compose and validate one job; returns the typed RootConfig."""
    from runtime.validation import validate

    return validate(strip_hydra(compose(overrides)))


# ------------------------------------------------------------------------------------------------
# Sweeps: expand every job so that each is validated up front
# ------------------------------------------------------------------------------------------------
def expand_sweep(overrides: list[str], cfg_with_hydra: Optional[DictConfig] = None) -> list[list[str]]:
    """Override lists of every job of a basic-sweeper multirun (grid over comma lists and ranges)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    extra: list[str] = []
    if cfg_with_hydra is not None:
        params = OmegaConf.select(cfg_with_hydra, "hydra.sweeper.params", default=None)
        if params:
            given = {parser.parse_override(o).key_or_group for o in overrides}
            extra = [f"{k}={v}" for k, v in params.items() if k not in given]
    try:
        parsed = parser.parse_overrides(overrides + extra)
    except Exception as err:
        raise ConfigError("", str(err).strip().splitlines()[0]) from None
    axes: list[list[str]] = []
    for o in parsed:
        if o.is_sweep_override():
            if o.is_interval_sweep():
                # continuous search spaces (Optuna) cannot be enumerated; check the interval's lower end
                axes.append([f"{o.get_key_element()}={o.value().start}"])
            else:
                axes.append([f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()])
        else:
            axes.append([o.input_line])
    jobs = [list(combo) for combo in itertools.product(*axes)]
    return jobs[:MAX_VALIDATED_JOBS]


def _check_launcher(cfg_with_hydra: DictConfig) -> None:
    """Resolve the launcher's settings now (the SLURM preset reads trainer.devices / num_nodes), so a
    bad value fails before any job is submitted, naming the key."""
    launcher = OmegaConf.select(cfg_with_hydra, "hydra.launcher", default=None)
    if launcher is None:
        return
    try:
        values = OmegaConf.to_container(launcher, resolve=True)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", "") or "hydra.launcher"
        raise ConfigError(key, str(getattr(err, "msg", err)).strip().splitlines()[0]) from None
    for key in ("nodes", "tasks_per_node"):
        if key in values and not (isinstance(values[key], int) and values[key] >= 1):
            raise ConfigError(
                f"hydra.launcher.{key}",
                f"must be a positive number, got {values[key]!r} (the SLURM launcher takes it from trainer.num_nodes "
                "/ trainer.devices: give trainer.devices as a number)",
            )


def swept_keys(overrides: list[str]) -> list[str]:
    """Keys given a sweep (comma list, range, choice, interval) on the command line."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    return [o.get_key_element().lstrip("+~") for o in parser.parse_overrides(overrides) if o.is_sweep_override()]


def varied_keys(jobs: list[list[str]]) -> list[str]:
    """Keys whose value differs between the jobs of a sweep, in override order."""
    seen: dict[str, set[str]] = {}
    for job in jobs:
        final = dict(split_override(o) for o in job)  # a key given twice: the last value counts, as in Hydra
        for key, value in final.items():
            seen.setdefault(key, set()).add(value)
    return [k for k, values in seen.items() if len(values) > 1]


# ------------------------------------------------------------------------------------------------
# Run folder
# ------------------------------------------------------------------------------------------------
def config_fingerprint(root: Any) -> str:
    from runtime.config import to_container

    data = to_container(root)
    data.pop("ckpt_path", None)
    data.pop("callbacks", None)  # extra callbacks observe or interrupt a run; they do not make it another run
    # how a run is observed, fits in memory or keeps its checkpoints, not what it trains
    for key in ("profiler", "activation_checkpointing", "keep_last_checkpoints"):
        data["trainer"].pop(key, None)
    return hashlib.sha1(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:6]


def _has_checkpoint(folder: Path) -> bool:
    return (folder / "checkpoints").is_dir() and any((folder / "checkpoints").glob("*.ckpt"))


def resolve_run_dir(root: Any) -> Path:
    """Where a single run writes. Fresh runs never reuse a folder that holds results."""
    from runtime.loggers import default_run_name

    base = Path(root.output_root) / (root.name or f"{default_run_name(root)}-{config_fingerprint(root)}")
    # the run's folders so far: base, base-2, base-3, ... (consecutive)
    existing = list(
        itertools.takewhile(
            Path.exists, (base.with_name(f"{base.name}-{i}") if i > 1 else base for i in itertools.count(1))
        )
    )
    if root.ckpt_path == "last":
        resumable = [p for p in existing if _has_checkpoint(p)]
        if resumable:
            return resumable[-1].resolve()
    elif root.ckpt_path is not None:
        ckpt = Path(root.ckpt_path)
        sharded = ckpt.is_dir() and (ckpt / ".metadata").is_file()  # an FSDP2 checkpoint folder
        if not (ckpt.is_file() or sharded):
            raise ConfigError(
                "ckpt_path",
                f"checkpoint not found: {root.ckpt_path} (use a .ckpt file or sharded .ckpt folder, 'last' or null)",
            )
        if ckpt.resolve().parent.name == "checkpoints":
            return ckpt.resolve().parent.parent  # continue in the run folder the checkpoint belongs to
    empty = [p for p in existing if not any(p.iterdir())]
    if empty:
        return empty[0].resolve()
    n = len(existing) + 1
    return (base if n == 1 else base.with_name(f"{base.name}-{n}")).resolve()


# ------------------------------------------------------------------------------------------------
# Entry point
# ------------------------------------------------------------------------------------------------
def _with_init_folder_composition(argv: list[str]) -> list[str]:
    """``argv`` preceded by the composition of an ``init_from`` folder transformers saved
    (``runtime.branching.with_folder_composition``)."""
    from runtime.branching import with_folder_composition

    given = [a for a in argv if not a.startswith("-")]
    merged, note = with_folder_composition(given)
    if note is None:
        return argv
    print(note, file=sys.stderr)
    return [*(o for o in merged if o not in given), *argv]


def run(task: Callable[[DictConfig], Any], argv: Optional[list[str]] = None) -> Any:
    """Validate, pin the run folder, then hand over to Hydra with ``task`` as the job function."""
    import hydra

    argv = list(sys.argv[1:] if argv is None else argv)
    if info_flags.answers(argv):  # --help, --cfg job|all: printed here, with the data's fields completed
        try:
            (info_flags.print_help if any(a in info_flags.HELP_FLAGS for a in argv) else info_flags.print_config)(argv)
        except (ConfigError, info_flags.InfoFlagError) as err:
            print(f"error: {err}", file=sys.stderr)
            sys.exit(EXIT_CONFIG_ERROR)
        return None
    if not any(a.split("=")[0] in INFO_FLAGS for a in argv):
        multirun = "-m" in argv or "--multirun" in argv
        argv = _with_init_folder_composition(argv)
        overrides = [a for a in argv if not a.startswith("-")]
        try:
            if multirun:
                first = compose([o for o in overrides if "," not in o])
                _check_launcher(first)
                jobs = expand_sweep(overrides, first)
                for job in jobs:
                    check_fits(validate_overrides(job))
                varied = varied_keys(jobs)
                varied += [k for k in swept_keys(overrides) if k not in varied]  # searched (Optuna) keys too
                handoff.publish_varied_keys(varied)
            else:
                root = validate_overrides(overrides)
                check_fits(root)
                pinned = handoff.pinned_run_dir()
                if pinned:
                    run_dir = Path(pinned)  # pinned for every rank (run.py pins it for the ranks Lightning spawns)
                else:  # one process, or every rank of a torchrun / srun launch: rank 0's choice
                    run_dir = agreed_run_dir(root.output_root, lambda: resolve_run_dir(root))
                argv.append(f"hydra.run.dir={run_dir}")
        except ConfigError as err:
            print(f"error: {err}", file=sys.stderr)
            sys.exit(EXIT_CONFIG_ERROR)

    from runtime import register_all

    register_all()
    handoff.set_script_args(argv)
    main = hydra.main(config_path=conf_dir(), config_name="config", version_base=None)(task)
    return main()
