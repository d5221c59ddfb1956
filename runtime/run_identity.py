"""Who a run is in W&B: its group, name, job type and the identity fields of its config.

* group: the configuration without the seed (a hash of everything that changes what is trained, with a
  readable label in front), so the seeds of one configuration share a group and two configurations never do;
  a sweep or ladder keeps its shared group instead (``logger.group``) and adds the point;
* name: what distinguishes the run (its experiment overlay and overrides, shortened readably) and the config
  hash of its run folder (seed included);
* job_type: ``train``, ``evaluation``, ``sweep-point`` or ``ladder-rung``;
* config fields W&B can filter on: the config hash, the run folder, the layer plan (``KKKM x 23 + M``).

Everything W&B shows is fitted to its limits here (tags 1-64 characters, names and groups 128, job types
64): a longer value is cut and ends with a hash of the whole, and the full value stays in the run's config.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from hydra.core.hydra_config import HydraConfig

from runtime.config import to_container
from runtime.run_folder import config_fingerprint
from runtime.sweep_job import split_override

TRAIN, EVALUATION, SWEEP_POINT, LADDER_RUNG = "train", "evaluation", "sweep-point", "ladder-rung"
JOB_TYPES = (TRAIN, EVALUATION, SWEEP_POINT, LADDER_RUNG)

# W&B's limits: a tag longer than 64 characters is refused at wandb.init; groups, names and job types
# longer than these are refused or cut by the server
TAG_LIMIT = 64
NAME_LIMIT = 128
JOB_TYPE_LIMIT = 64

# one letter per mixer / FFN in the layer-plan strings; others get their name's first letter (or the name)
MIXER_LETTERS = {"kda": "K", "mla": "M", "gqa": "G", "mha": "A", "mqa": "Q"}
FFN_LETTERS = {"dense": "D", "moe": "E", "latent_moe": "L", "stable_latent_moe": "S"}

# overrides that say where or how a run is observed, not what it trains: left out of its label
_NOT_IDENTITY_KEYS = ("output_root", "ckpt_path", "name", "logger", "callbacks", "hydra")
_NOT_IDENTITY_TRAINER = (
    "profiler",
    "activation_checkpointing",
    "keep_last_checkpoints",
    "enable_progress_bar",
    "checkpoint_every_n_steps",
    "log_every_n_steps",
    "memory_check",
)
_VALUE_LIMIT = 24  # an override value longer than this is shortened in labels


def short_hash(text: str, n: int = 6) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:n]


def fit(value: str, limit: int) -> str:
    """``value`` if it fits in ``limit`` characters, else its head, ``~`` and a hash of the whole (``limit`` long)."""
    value = str(value)
    if len(value) <= limit:
        return value
    digest = short_hash(value)
    return value[: limit - len(digest) - 1] + "~" + digest


def fit_tags(tags: Iterable[str]) -> tuple[list[str], dict[str, str]]:
    """Tags W&B accepts (1-64 characters, each once) and ``{shortened: full}`` for the ones cut."""
    fitted, cut = [], {}
    for tag in tags:
        tag = str(tag).strip()
        if not tag:
            continue
        short = fit(tag, TAG_LIMIT)
        if short != tag:
            cut[short] = tag
        if short not in fitted:
            fitted.append(short)
    return fitted, cut


# -- layer plans ------------------------------------------------------------------------------------------
def _letters(names: list[str], table: dict[str, str]) -> list[str]:
    used = dict(table)
    out = []
    for name in names:
        if name not in used:
            letter = name[:1].upper()
            used[name] = letter if letter not in used.values() else f"({name})"
        out.append(used[name])
    return out


def compress(symbols: list[str]) -> str:
    """``KKKMKKKMKKKMM`` -> ``KKKM x 3 + M``, ``DSSSSSSS`` -> ``D + S x 7``: runs of a repeated unit and the
    plain symbols between them. The text with the fewest things to read wins (a plain symbol is one, a
    repeated unit its length and two), the plain sequence between equals."""
    best: dict[int, tuple[int, str]] = {len(symbols): (0, "")}

    def join(cost: int, head: str, i: int) -> tuple[int, str]:
        rest_cost, rest = best[i]
        return cost + rest_cost, head + (f" + {rest}" if rest else "")

    for start in range(len(symbols) - 1, -1, -1):
        options = [join(end - start, "".join(symbols[start:end]), end) for end in range(start + 1, len(symbols) + 1)]
        for unit_len in range(1, (len(symbols) - start) // 2 + 1):
            unit = symbols[start : start + unit_len]
            n = 1
            while symbols[start + n * unit_len : start + (n + 1) * unit_len] == unit:
                n += 1
            if n >= 2:
                options.append(join(unit_len + 2, f"{''.join(unit)} x {n}", start + n * unit_len))
        best[start] = min(options, key=lambda option: (option[0], option[1].count(" x "), option[1].count(" + ")))
    return best[0][1]


def layer_plans(root: Any) -> dict[str, str]:
    """``layer_plan`` (mixers, e.g. ``KKKM x 2``), ``ffn_plan`` (e.g. ``D + S x 7``) and the letters' meaning."""
    plan = root.decoder_config().layers
    mixers = [spec.mixer.name for spec in plan]
    ffns = [spec.ffn.name for spec in plan]
    mixer_letters, ffn_letters = _letters(mixers, MIXER_LETTERS), _letters(ffns, FFN_LETTERS)
    legend = dict.fromkeys(f"{s}={n}" for s, n in [*zip(mixer_letters, mixers), *zip(ffn_letters, ffns)])
    return {
        "layer_plan": compress(mixer_letters),
        "ffn_plan": compress(ffn_letters),
        "plan_letters": " ".join(legend),
    }


# -- overrides and hashes ---------------------------------------------------------------------------------
def identity_overrides(overrides: Iterable[str], with_seed: bool = True) -> list[str]:
    """The overrides that change what a run trains (the last value of a key given twice), in order."""
    final: dict[str, str] = {}
    for override in overrides:
        key, value = split_override(override)
        top, _, rest = key.partition(".")
        if top in _NOT_IDENTITY_KEYS or (top == "trainer" and rest in _NOT_IDENTITY_TRAINER):
            continue
        if key == "seed" and not with_seed:
            continue
        final.pop(key, None)
        final[key] = value
    return [f"{k}={v}" for k, v in final.items()]


def readable_label(overrides: list[str]) -> str:
    """``experiment=k3_small_swiglu optimizer.lr=0.001`` -> ``k3_small_swiglu lr=0.001``: the experiment by
    name, dotted keys by their last part (the whole key where two would read the same), long values cut
    with a hash."""
    keys = [split_override(o)[0] for o in overrides]
    last_parts = [k.rsplit(".", 1)[-1] for k in keys]
    parts = []
    for override, key, last in zip(overrides, keys, last_parts):
        value = split_override(override)[1]
        if key == "experiment":
            parts.append(value)
            continue
        shown = last if last_parts.count(last) == 1 else key
        parts.append(f"{shown}={fit(value, _VALUE_LIMIT)}")
    return " ".join(parts) or "default"


def config_hash(data: dict[str, Any]) -> str:
    return hashlib.sha1(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:6]


def group_hash(root: Any) -> str:
    """A hash of everything that changes what a run trains, the seed left out."""
    data = to_container(root)
    for key in (*_NOT_IDENTITY_KEYS, "seed"):
        data.pop(key, None)
    for key in _NOT_IDENTITY_TRAINER:
        data.get("trainer", {}).pop(key, None)
    return config_hash(data)


def hydra_overrides() -> Optional[list[str]]:
    """The running Hydra job's command-line overrides (None outside a Hydra job)."""
    if not HydraConfig.initialized():
        return None
    return list(HydraConfig.get().overrides.task)


def job_type_for(sweep: Optional[dict[str, Any]] = None, ladder: bool = False) -> str:
    """``ladder-rung`` for a ladder's runs, ``sweep-point`` for a sweep's (``sweep``: the job's sweep
    record), else ``train``."""
    if ladder:
        return LADDER_RUNG
    return SWEEP_POINT if sweep else TRAIN


@dataclass
class RunIdentity:
    group: str
    name: str
    job_type: str
    label: str
    config_hash: str
    group_hash: str
    overrides: list[str]
    plans: dict[str, str] = field(default_factory=dict)
    run_dir: str = ""

    def config_fields(self) -> dict[str, Any]:
        """The ``run`` node of the W&B config: what a filter or a group-by picks runs with."""
        return {
            "config_hash": self.config_hash,
            "group_hash": self.group_hash,
            "run_dir": self.run_dir,
            "label": self.label,
            "overrides": self.overrides,
            "job_type": self.job_type,
            "group": self.group,
            "name": self.name,
            **self.plans,
        }


def run_identity(
    root: Any,
    overrides: Optional[list[str]] = None,
    run_dir: str = "",
    job_type: str = TRAIN,
    group: Optional[str] = None,
) -> RunIdentity:
    """The identity of the run ``root`` composes from ``overrides`` (None: the running Hydra job's).
    ``group``: a shared group (a sweep's, a ladder's, ``logger.group``) instead of the configuration's."""
    if overrides is None:
        overrides = hydra_overrides() or []
    full = identity_overrides(overrides)
    label = readable_label(full)
    group_label = readable_label(identity_overrides(overrides, with_seed=False))
    fingerprint, by_config = config_fingerprint(root), group_hash(root)
    if job_type not in JOB_TYPES:
        raise ValueError(f"job_type {job_type!r}: one of {', '.join(JOB_TYPES)}")
    return RunIdentity(
        group=fit(group, NAME_LIMIT) if group else f"{fit(group_label, NAME_LIMIT - 7)} {by_config}",
        name=f"{fit(label, NAME_LIMIT - 7)} {fingerprint}",  # the hash kept whole at the end
        job_type=fit(job_type, JOB_TYPE_LIMIT),
        label=label,
        config_hash=fingerprint,
        group_hash=by_config,
        overrides=full,
        plans=layer_plans(root),
        run_dir=run_dir,
    )
