"""The GLU activations an FFN can use, and the config fields every GLU FFN shares.

An activation is registered once with its function (``components/ops/activations.py``), the FFN-config
fields it is bound with, and the kernel op whose back-end choice its config makes. The FFN configs
(dense, MoE, LatentMoE, ...) subclass ``GLUActivationConfig`` and ask the registry; nothing else names
an activation. A new activation is a function plus one ``register_glu_activation`` call here.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Optional

from components.base import ComponentConfig, ConfigError
from components.ops.activations import GluFn, glu, situ_glu, swiglu
from components.ops.backend import BACKENDS, allowed_backends
from components.registry import unknown_choice_message


@dataclass(frozen=True)
class GLUActivation:
    """One registered activation.

    ``settings`` maps the function's keyword arguments to the ``GLUActivationConfig`` fields that
    supply them; ``kernel_op`` names the op in ``components/ops/backend.py`` whose back-end the
    config's ``activation_backend`` chooses (None: the activation has no kernel).
    """

    name: str
    fn: GluFn
    settings: dict[str, str] = field(default_factory=dict)
    kernel_op: Optional[str] = None

    def bind(self, cfg: "GLUActivationConfig") -> GluFn:
        kwargs = {arg: getattr(cfg, attr) for arg, attr in self.settings.items()}
        if self.kernel_op is not None:
            kwargs["backend"] = cfg.activation_backend
        return functools.partial(self.fn, **kwargs) if kwargs else self.fn


GLU_ACTIVATIONS: dict[str, GLUActivation] = {}


def register_glu_activation(
    name: str, fn: GluFn, settings: Optional[dict[str, str]] = None, kernel_op: Optional[str] = None
) -> GLUActivation:
    if name in GLU_ACTIVATIONS and GLU_ACTIVATIONS[name].fn is not fn:
        raise KeyError(f"GLU activation '{name}' is registered twice")
    entry = GLU_ACTIVATIONS[name] = GLUActivation(name, fn, dict(settings or {}), kernel_op)
    return entry


def get_glu_activation(name: str, key: str = "ffn.activation") -> GLUActivation:
    if name not in GLU_ACTIVATIONS:
        raise ConfigError(key, unknown_choice_message("activation", name, list(GLU_ACTIVATIONS)))
    return GLU_ACTIVATIONS[name]


def glu_activation(name: str, **kwargs) -> GluFn:
    """The function registered as ``name`` with ``kwargs`` bound (outside a config: tests, benchmarks)."""
    fn = get_glu_activation(name).fn
    if not kwargs:
        return fn
    inspect.signature(fn).bind_partial(None, None, **kwargs)  # TypeError now, not at the first call
    return functools.partial(fn, **kwargs)


register_glu_activation("glu", glu)
register_glu_activation("swiglu", swiglu)
register_glu_activation(
    "situ_glu", situ_glu, settings={"beta": "situ_beta", "linear_beta": "situ_linear_beta"}, kernel_op="situ_glu"
)


@dataclass
class GLUActivationConfig(ComponentConfig):
    """Activation fields shared by every GLU FFN: ``glu``, ``swiglu`` or ``situ_glu`` (K3)."""

    activation: str = "situ_glu"
    # SiTU-GLU softcaps: gate cap beta (K3: 4) and value cap linear_beta (K3: 25; None = uncapped)
    situ_beta: float = 4.0
    situ_linear_beta: Optional[float] = 25.0
    # back-end of an activation with a kernel: torch (reference), its kernel, or auto (components/ops/backend.py)
    activation_backend: str = "auto"

    def activation_fn(self) -> GluFn:
        return get_glu_activation(self.activation).bind(self)

    def kernel_backends(self) -> dict[str, str]:
        op = get_glu_activation(self.activation).kernel_op
        return {"activation_backend": self.activation_backend} if op is not None else {}

    def tags(self) -> list[str]:
        return [f"act:{self.activation}"]

    def validate_activation(self, key: str) -> None:
        entry = get_glu_activation(self.activation, f"{key}.activation")
        if self.situ_beta <= 0:
            raise ConfigError(f"{key}.situ_beta", f"must be positive, got {self.situ_beta}")
        if self.situ_linear_beta is not None and self.situ_linear_beta <= 0:
            raise ConfigError(f"{key}.situ_linear_beta", f"must be positive or null, got {self.situ_linear_beta}")
        allowed_choices = allowed_backends(entry.kernel_op) if entry.kernel_op is not None else BACKENDS
        if self.activation_backend not in allowed_choices:
            allowed = ", ".join(allowed_choices)
            raise ConfigError(
                f"{key}.activation_backend", f"'{self.activation_backend}' is not allowed; choose one of {allowed}"
            )
