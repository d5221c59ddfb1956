"""Component registries: short name -> (module class, config dataclass).

Registering a component makes it selectable from the command line (``mixer=gqa``), gives it a typed
Hydra schema (so ``mixer.n_kv_heads=two`` is refused), lists it in ``python -m components.catalog``, and
puts it under the registry-driven tests (``tests/contracts/``). A member's config subclasses
``components.base.ComponentConfig`` and its class subclasses the family's contract (``base`` below). A
new component is one module that calls ``REGISTRY.register`` plus one YAML file in ``conf/<group>/``; the
package imports every module of a family on first use, so nothing else needs editing.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import pkgutil
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

from components.base import ComponentConfig, ConfigError


def closest(name: str, choices: list[str]) -> str | None:
    matches = difflib.get_close_matches(name, choices, n=1, cutoff=0.5)
    return matches[0] if matches else None


def unknown_choice_message(kind: str, name: str, choices: list[str], listing: str = "Registered") -> str:
    msg = f"unknown {kind} '{name}'. {listing}: {', '.join(sorted(choices))}."
    guess = closest(name, choices)
    if guess is not None:
        msg += f" Did you mean '{guess}'?"
    return msg


@dataclass(frozen=True)
class Entry:
    name: str
    cls: type
    config_cls: type
    summary: str


class Registry:
    """Name -> component class for one family (mixers, FFNs, ...).

    ``group`` is the Hydra config group whose YAML files select members of this family; each member's
    config dataclass is stored in Hydra's ConfigStore as ``<group>/<name>_schema``, which the YAML file
    lists first in its defaults so that composition is type-checked against it.
    """

    def __init__(self, family: str, group: str, package: str, base: Optional[str] = None):
        self.family = family
        self.group = group
        self.package = package
        # "module:Class" every member must subclass (the family's written contract); None for families
        # whose members are factory functions (optimizers)
        self.base = base
        self._entries: dict[str, Entry] = {}
        self._discovered = False

    # -- registration ---------------------------------------------------------------------------
    def register(self, name: str, config_cls: type, summary: str | None = None) -> Callable[[type], type]:
        if not dataclasses.is_dataclass(config_cls):
            raise TypeError(f"{self.family} '{name}': config must be a dataclass, got {config_cls!r}")
        if "name" not in {f.name for f in dataclasses.fields(config_cls)}:
            raise TypeError(f"{self.family} '{name}': config dataclass needs a `name: str` field")
        if not issubclass(config_cls, ComponentConfig):
            raise TypeError(
                f"{self.family} '{name}': config {config_cls.__name__} must subclass components.base.ComponentConfig"
            )

        def decorator(cls: type) -> type:
            base = self.base_class()
            if base is not None and not (isinstance(cls, type) and issubclass(cls, base)):
                raise TypeError(
                    f"{self.family} '{name}': {getattr(cls, '__name__', cls)} must subclass "
                    f"{base.__module__}.{base.__name__} (the {self.family} contract)"
                )
            if name in self._entries and self._entries[name].cls is not cls:
                raise KeyError(f"{self.family} '{name}' is registered twice")
            doc = (cls.__doc__ or "").strip().splitlines()
            self._entries[name] = Entry(name, cls, config_cls, summary or (doc[0] if doc else ""))
            _store_schema(self.group, name, config_cls)
            return cls

        return decorator

    def base_class(self) -> Optional[type]:
        if self.base is None:
            return None
        module, _, attr = self.base.partition(":")
        return getattr(importlib.import_module(module), attr)

    # -- lookup ---------------------------------------------------------------------------------
    def discover(self) -> None:
        """Import every module of the family's package so that their ``register`` calls run."""
        if self._discovered:
            return
        self._discovered = True
        pkg = importlib.import_module(self.package)
        for info in pkgutil.iter_modules(pkg.__path__):
            if not info.name.startswith("_"):
                importlib.import_module(f"{self.package}.{info.name}")

    def names(self) -> list[str]:
        self.discover()
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        self.discover()
        return name in self._entries

    def __iter__(self) -> Iterator[Entry]:
        self.discover()
        return iter(self._entries[n] for n in sorted(self._entries))

    def get(self, name: str, key: str | None = None) -> Entry:
        self.discover()
        if name not in self._entries:
            raise ConfigError(
                key or f"{self.group}.name", unknown_choice_message(self.family, name, list(self._entries))
            )
        return self._entries[name]

    def build(self, cfg: Any, *args: Any, key: str | None = None, **kwargs: Any) -> Any:
        """Instantiate the member named ``cfg.name`` with ``cfg`` (a config dataclass) and extra args."""
        entry = self.get(cfg.name, key)
        if not isinstance(cfg, entry.config_cls):
            raise ConfigError(key or self.group, f"expected a {entry.config_cls.__name__}, got {type(cfg).__name__}")
        return entry.cls(cfg, *args, **kwargs)


def _store_schema(group: str, name: str, config_cls: type) -> None:
    from hydra.core.config_store import ConfigStore  # start-up time: hydra, only for the config store

    ConfigStore.instance().store(group=group, name=f"{name}_schema", node=config_cls)


# The families. Each lives in its own subpackage; ``discover`` imports its modules lazily.
MIXERS = Registry("mixer", "mixer", "components.mixers", "components.mixers.base:Mixer")
FFNS = Registry("ffn", "ffn", "components.ffn", "components.ffn.base:FFN")
BALANCERS = Registry("balancer", "balancer", "components.balancers", "components.balancers.base:Balancer")
RESIDUALS = Registry("residual", "residual", "components.residual", "components.residual.base:ResidualScheme")
DATASETS = Registry("dataset", "data", "components.data", "components.data.base:TokenDataset")
# members are functions ``build(cfg, model) -> torch.optim.Optimizer``
OPTIMIZERS = Registry("optimizer", "optimizer", "components.optim")

FAMILIES: dict[str, Registry] = {r.group: r for r in (MIXERS, FFNS, BALANCERS, RESIDUALS, DATASETS, OPTIMIZERS)}
# the families whose members are parts of the decoder (a choice changes the model's parameters)
MODEL_FAMILIES: tuple[Registry, ...] = (MIXERS, FFNS, BALANCERS, RESIDUALS)


def discover_all() -> None:
    for registry in FAMILIES.values():
        registry.discover()
