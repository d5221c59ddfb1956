"""Parameter names of a composed decoder in Hugging Face checkpoints, both ways.

K3-family models take the released K3 layout (the release's tensor names); the other components take
the conventional names of the same modules (Llama-style attention and norms, Mixtral/DeepSeek-style
routed experts), which are the K3 names where the module is the same. Under a prefix ``P`` (``model.``
text-only, or the release's multimodal ``language_model.model.``), per decoder layer ``i``:

=========================================  ============================================================
sandbox                                    checkpoint
=========================================  ============================================================
``embed.weight``                           ``P embed_tokens.weight``
``norm.weight``                            ``P norm.weight``
``lm_head.weight``                         ``lm_head.weight`` (multimodal: ``language_model.lm_head.weight``;
                                           absent when tied to the embedding)
``layers.i.mixer_norm.weight``             ``P layers.i.input_layernorm.weight``
``layers.i.ffn_norm.weight``               ``P layers.i.post_attention_layernorm.weight``
``layers.i.mixer.<name>``                  ``P layers.i.self_attn.<name>`` (MHA/GQA/MQA, MLA and KDA alike)
``layers.i.ffn.<gate|up|down>_proj``       ``P layers.i.mlp.<gate|up|down>_proj`` (dense FFN)
``layers.i.ffn.experts.w1 [E, m, d]``      ``P layers.i.block_sparse_moe.experts.<e>.w1.weight`` per expert
                                           (``w3`` up, ``w2`` down; MXFP4: ``weight_packed`` + ``weight_scale``)
``layers.i.ffn.<other>``                   ``P layers.i.block_sparse_moe.<other>`` (router ``gate``, its
                                           ``e_score_correction_bias``, ``shared_experts``, latent projections
                                           and norm)
``residual.<name>``                         ``P <the scheme's checkpoint_names()>`` (AttnRes: the release's
                                           ``layers.i.<self_attention|mlp>_res_<proj|norm>.weight`` and
                                           ``output_attn_res_<proj|norm>.weight``, queries as ``[1, d]``)
``mtp.j.<hidden|embed>_norm``              ``P layers.<L+j>.<hnorm|enorm>.weight`` (DeepSeek-V3's MTP layout)
``mtp.j.proj [d, 2d]``                     ``P layers.<L+j>.eh_proj.weight`` (its input halves swapped: the
                                           checkpoint's order is [embedding, hidden])
``mtp.j.<the block>``                      ``P layers.<L+j>.<as a decoder layer>``
=========================================  ============================================================

A parameter without a rule is an error (``UnmappedKey``), never skipped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch

from components.model import Decoder
from components.residual.base import CheckpointName

TEXT_PREFIX = "model."
MULTIMODAL_PREFIX = "language_model.model."
PREFIXES = {"text": TEXT_PREFIX, "multimodal": MULTIMODAL_PREFIX}
EXPERT_MATRICES = ("w1", "w2", "w3")


class UnmappedKey(KeyError):
    """A parameter (or checkpoint tensor) with no counterpart; the message names it."""

    def __str__(self) -> str:
        return str(self.args[0])


def lm_head_key(prefix: str) -> str:
    return "language_model.lm_head.weight" if prefix == MULTIMODAL_PREFIX else "lm_head.weight"


@dataclass(frozen=True)
class Mapping:
    """One sandbox tensor as checkpoint tensors: ``keys`` and the conversions both ways."""

    keys: tuple[str, ...]
    to_checkpoint: Callable[[torch.Tensor], list[torch.Tensor]]
    from_checkpoint: Callable[[list[torch.Tensor]], torch.Tensor]


def _same(key: str) -> Mapping:
    return Mapping((key,), lambda t: [t], lambda ts: ts[0])


def _reshaped(key: str, stored: tuple[int, ...], own: tuple[int, ...]) -> Mapping:
    """A tensor of shape ``own`` stored with shape ``stored`` (same numbers, same order)."""
    return Mapping((key,), lambda t: [t.reshape(stored)], lambda ts: ts[0].reshape(own))


def _experts(base: str, matrix: str, num_experts: int) -> Mapping:
    keys = tuple(f"{base}.{e}.{matrix}.weight" for e in range(num_experts))
    return Mapping(keys, lambda t: list(t.unbind(0)), lambda ts: torch.stack(ts))


def _swapped_halves(key: str) -> Mapping:
    def swap(t: torch.Tensor) -> torch.Tensor:
        a, b = t.chunk(2, dim=-1)
        return torch.cat([b, a], dim=-1)

    return Mapping((key,), lambda t: [swap(t)], lambda ts: swap(ts[0]))


_BLOCK_NORMS = {"mixer_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_MTP_NAMES = {"hidden_norm": "hnorm", "embed_norm": "enorm"}
_DENSE = re.compile(r"^(gate_proj|up_proj|down_proj)\.weight$")


def _block_mapping(block_prefix: str, rest: str, num_experts: dict[str, int], owner: str) -> Mapping:
    """A decoder block's own parameter ``rest`` (below ``layers.i.`` or ``mtp.j.``)."""
    head, _, tail = rest.partition(".")
    if head in _BLOCK_NORMS and tail == "weight":
        return _same(f"{block_prefix}{_BLOCK_NORMS[head]}.weight")
    if head == "mixer":
        return _same(f"{block_prefix}self_attn.{tail}")
    if head == "ffn":
        m = re.match(r"^experts\.(w[123])$", tail)
        if m:
            return _experts(f"{block_prefix}block_sparse_moe.experts", m.group(1), num_experts[owner])
        if owner not in num_experts and _DENSE.match(tail):
            return _same(f"{block_prefix}mlp.{tail}")
        if owner in num_experts:
            return _same(f"{block_prefix}block_sparse_moe.{tail}")
    raise UnmappedKey(f"parameter '{owner}.{rest}' has no checkpoint name")


def _residual_mapping(key: str, names: dict[str, CheckpointName], tensor: torch.Tensor, prefix: str) -> Mapping:
    name = names.get(key.removeprefix("residual."))
    if name is None:
        raise UnmappedKey(f"parameter '{key}' has no checkpoint name (the residual scheme's checkpoint_names())")
    own = tuple(tensor.shape)
    if name.shape is None or tuple(name.shape) == own:
        return _same(f"{prefix}{name.key}")
    return _reshaped(f"{prefix}{name.key}", tuple(name.shape), own)


def checkpoint_mappings(model: Decoder, prefix: str = TEXT_PREFIX) -> dict[str, Mapping]:
    """``{sandbox state-dict key: Mapping}`` for every persistent tensor of ``model``."""
    if prefix not in PREFIXES.values():
        raise ValueError(f"prefix must be one of {sorted(PREFIXES.values())}, got {prefix!r}")
    n_layers = len(model.layers)
    num_experts = {}
    for name, blocks in (("layers", model.layers), ("mtp", model.mtp)):
        for i, block in enumerate(blocks):
            routed = block.ffn.routed_experts()
            if routed is not None:
                num_experts[f"{name}.{i}"] = routed.num_experts
    tied = model.lm_head.weight is model.embed.weight
    residual_names = model.residual.checkpoint_names()
    state = model.state_dict()
    out: dict[str, Mapping] = {}
    for key in state:
        if key == "embed.weight":
            out[key] = _same(f"{prefix}embed_tokens.weight")
        elif key == "norm.weight":
            out[key] = _same(f"{prefix}norm.weight")
        elif key == "lm_head.weight":
            if not tied:
                out[key] = _same(lm_head_key(prefix))
        elif m := re.match(r"^layers\.(\d+)\.(.+)$", key):
            out[key] = _block_mapping(f"{prefix}layers.{m.group(1)}.", m.group(2), num_experts, f"layers.{m.group(1)}")
        elif key.startswith("residual."):
            out[key] = _residual_mapping(key, residual_names, state[key], prefix)
        elif m := re.match(r"^mtp\.(\d+)\.(.+)$", key):
            j, rest = int(m.group(1)), m.group(2)
            block_prefix = f"{prefix}layers.{n_layers + j}."
            head, _, tail = rest.partition(".")
            if head in _MTP_NAMES and tail == "weight":
                out[key] = _same(f"{block_prefix}{_MTP_NAMES[head]}.weight")
            elif rest == "proj.weight":
                out[key] = _swapped_halves(f"{block_prefix}eh_proj.weight")
            else:
                out[key] = _block_mapping(block_prefix, rest, num_experts, f"mtp.{j}")
        else:
            raise UnmappedKey(f"parameter '{key}' has no checkpoint name")
    return out


def to_checkpoint(model: Decoder, prefix: str = TEXT_PREFIX) -> dict[str, torch.Tensor]:
    """``{checkpoint key: tensor}`` of ``model``'s weights (views where the layout allows)."""
    state = model.state_dict()
    out: dict[str, torch.Tensor] = {}
    for key, mapping in checkpoint_mappings(model, prefix).items():
        out.update(zip(mapping.keys, mapping.to_checkpoint(state[key].detach())))
    return out


def checkpoint_prefix(keys: list[str]) -> str:
    """The prefix a checkpoint's keys use (``model.`` or ``language_model.model.``)."""
    if any(k.startswith(MULTIMODAL_PREFIX) or k == lm_head_key(MULTIMODAL_PREFIX) for k in keys):
        return MULTIMODAL_PREFIX
    return TEXT_PREFIX
