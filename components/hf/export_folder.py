"""A composed model written as a Hugging Face model folder that the ecosystem opens.

``write_model_folder`` writes the weights (``components/hf/weights_folder.py``), a ``config.json`` in the
schema of the class the model is labelled with (``components/hf/native.py``), the tokenizer files and
``generation_config.json`` (``components/hf/tokenizer_files.py``), and for the project's own classes the
``modeling_k3_sandbox.py`` their ``auto_map`` names. What each kind of model loads as:

* Llama-expressible (MHA/GQA/MQA, RoPE, dense SwiGLU, plain residual): ``LlamaForCausalLM``;
* Kimi-Linear-expressible: ``KimiLinearForCausalLM``, tensors in that class's shapes;
* a K3-family model with the release's multimodal prefix: the release's top-level ``kimi_k3`` schema
  (text backbone under ``text_config``), loaded by the project's registered class;
* anything else: ``K3SandboxForCausalLM`` (``model_type: k3_sandbox``), the project's registered class.

Every config.json also carries the run's composed config (``k3_sandbox``), from which
``runtime.load_run`` rebuilds the exact model, and MXFP4 exports carry a compressed-tensors
``quantization_config`` (``mxfp4-pack-quantized``, groups of 32, routed experts only).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional

import torch

from components.data.text.tokenizers import TextTokenizer
from components.hf import native
from components.hf.config_json import SANDBOX_KEY, TOKENIZER_KEY, checkpoint_config, write_config
from components.hf.key_map import TEXT_PREFIX
from components.hf.modeling_file import AUTO_MAP, write_modeling_file
from components.hf.mxfp4 import GROUP
from components.hf.tokenizer_files import special_token_ids, write_generation_config, write_tokenizer_files
from components.hf.weights_folder import export_weights
from components.model import Decoder

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# the routed experts' matrices, the only tensors --mxfp4-experts packs
MXFP4_TARGETS = [r"re:.*block_sparse_moe\.experts\.\d+\.w[123]$"]
# what the release leaves unquantised, and the project's other linear layers
MXFP4_IGNORE = [
    "re:.*self_attn.*",
    "re:.*shared_experts.*",
    r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
    r"re:.*block_sparse_moe\.gate$",
    "re:.*routed_expert_(down|up)_proj$",
    "re:.*_res_proj$",
    "re:.*eh_proj$",
    "re:.*lm_head.*",
]


@dataclass(frozen=True)
class ExportedFolder:
    weights: list[str]
    other: list[str]
    layout: native.Layout

    def summary(self) -> str:
        return (
            f"{self.layout.describe()}; {len(self.weights)} weight file(s) ({', '.join(self.weights)}), "
            f"{', '.join(self.other)}"
        )


def quantization_config() -> dict:
    """compressed-tensors' description of ``--mxfp4-experts``: FP4 E2M1 weights in groups of 32 with
    an E8M0 (uint8) scale per group, ``mxfp4-pack-quantized``; activations as they are."""
    weights = {
        "num_bits": 4,
        "type": "float",
        "symmetric": True,
        "strategy": "group",
        "group_size": GROUP,
        "dynamic": False,
        "scale_dtype": "torch.uint8",
        "zp_dtype": None,
        "observer": None,
    }
    group = {
        "targets": MXFP4_TARGETS,
        "weights": weights,
        "input_activations": None,
        "output_activations": None,
        "format": "mxfp4-pack-quantized",
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": MXFP4_IGNORE,
        "kv_cache_scheme": None,
    }


def model_config(
    root: Any,
    model: Decoder,
    run_config: dict,
    layout: native.Layout,
    tokenizer: Optional[TextTokenizer] = None,
    dtype: Optional[torch.dtype] = None,
    mxfp4_experts: bool = False,
    max_length: Optional[int] = None,
) -> dict:
    """The ``config.json`` dict of ``model`` labelled as ``layout``."""
    release = checkpoint_config(root, model, run_config)
    release.pop(SANDBOX_KEY)
    release.pop("architectures")
    release.pop("model_type")
    ids = (
        special_token_ids(tokenizer)
        if tokenizer is not None
        else dict.fromkeys(("eos_token_id", "bos_token_id", "pad_token_id"))
    )
    dtype_name = DTYPE_NAMES.get(dtype, "float32") if dtype is not None else release.pop("torch_dtype")
    release.pop("torch_dtype", None)
    common: dict[str, Any] = {**ids, "torch_dtype": dtype_name}
    if max_length:
        common["max_position_embeddings"] = max_length
    if layout.architecture == native.LLAMA:
        body = native.llama_config(model)
    elif layout.architecture == native.KIMI_LINEAR:
        body = {**release, **native.kimi_linear_config(model)}
    else:
        body = release
    if layout.architecture == native.KIMI_K3:
        text = {"model_type": "kimi_linear", **body, **common}
        if mxfp4_experts:
            text["quantization_config"] = quantization_config()
        cfg = {"architectures": [layout.architecture], "model_type": layout.model_type, "text_config": text}
        cfg.update({k: common[k] for k in ids})
        cfg.update({"tie_word_embeddings": body["tie_word_embeddings"], "torch_dtype": dtype_name})
    else:
        cfg = {"architectures": [layout.architecture], "model_type": layout.model_type, **body, **common}
    if layout.model_type in AUTO_MAP:
        cfg["auto_map"] = AUTO_MAP[layout.model_type]
    if mxfp4_experts:
        cfg["quantization_config"] = quantization_config()
    cfg[SANDBOX_KEY] = run_config
    if tokenizer is not None:
        cfg[TOKENIZER_KEY] = tokenizer.describe()
    return cfg


def write_model_folder(
    folder: str,
    root: Any,
    model: Decoder,
    run_config: dict,
    prefix: str = TEXT_PREFIX,
    max_shard_bytes: int = 5 << 30,
    dtype: Optional[torch.dtype] = None,
    mxfp4_experts: bool = False,
    tokenizer: Optional[TextTokenizer] = None,
) -> ExportedFolder:
    """Write ``model`` (composed by ``root``, whose plain dict is ``run_config``) into the empty folder
    ``folder``; ``tokenizer``: the run's (None: no tokenizer files, no special ids)."""
    layout = native.choose(model, prefix, mxfp4_experts)
    weights = export_weights(
        model,
        folder,
        prefix,
        max_shard_bytes,
        dtype,
        mxfp4_experts,
        shape_of=functools.partial(native.native_shape, layout),
    )
    max_length = getattr(getattr(root, "data", None), "seq_len", None)
    cfg = model_config(root, model, run_config, layout, tokenizer, dtype, mxfp4_experts, max_length)
    write_config(cfg, folder)
    other = ["config.json"]
    if tokenizer is not None:
        other += write_tokenizer_files(folder, tokenizer, max_length)
        other.append(write_generation_config(folder, special_token_ids(tokenizer)))
    if not layout.native:
        other.append(write_modeling_file(folder))
    return ExportedFolder(weights, other, layout)
