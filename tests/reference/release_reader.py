"""An exported folder read by the released K3 modeling code (the ``kimi_k3`` files the ``llmcompressor``
package ships) as a user of the release reads it, on the CPU in fp32; what it computed is saved for the
project's side of tests/reference/test_release_parity.py to compare.

    REFERENCE_PYTHON tests/reference/release_reader.py FOLDER PROMPT.pt NEW_TOKENS OUT.pt

Runs under the reference environment (tests/reference/setup_reference_env.sh), not the project's. Its
files are loaded by path (the package's own ``__init__`` pulls in a heavy stack). Its KDA layers call fla's
Triton kernels, run here by the Triton interpreter (``TRITON_INTERPRET=1``) with the runtime shims of
``triton_shims.py``.

What is read from the folder, and how:

* the configuration from ``config.json`` alone, by the release's own config class: ``KimiLinearConfig``
  for the flat text schema (the folder's ``model_type`` names the project's class, ``k3_sandbox``; the
  release's class reads the same flat text fields whatever the label), ``KimiK3Config`` for the
  multimodal schema (text fields under ``text_config``);
* the weights, strictly and under their own names: the flat folder through ``from_pretrained`` (which
  hands a ``quantization_config`` to compressed-tensors, whose own code decompresses MXFP4 experts), the
  multimodal folder's ``language_model.*`` tensors by ``load_state_dict(strict=True)`` into a module whose
  ``language_model`` is the release's ``KimiLinearForCausalLM``, as ``KimiK3ForConditionalGeneration``
  holds it (that class itself also builds a vision tower from ``vision_config``, which a text-only export
  has none of);
* MTP depths (``model.layers.L+j.*``): the release has no MTP module, so they are left out of the strict
  load and reported; the project's side checks that they are exactly the folder's MTP tensors.

Saved: the config fields the release read, the names left unloaded, every loaded tensor, the logits of
the prompt (one uncached forward) and the release's own cached ``generate()``: greedy tokens, each
step's logits and the number of positions each step's forward was given.
"""

from __future__ import annotations

import os

# Must be set before `triton` is first imported (triton.jit reads it at decoration time).
os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("OMP_NUM_THREADS", "1")

import importlib.machinery  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import types  # noqa: E402

import torch  # noqa: E402

torch.set_num_threads(1)

# the interpreter shims, shared with the project's kernel checks (run as a script, this folder is on sys.path)
from triton_shims import install_triton_cpu_shims  # noqa: E402  (after TRITON_INTERPRET is set)

# the config fields that carry the K3 decisions, as the release's config object holds them
DECISION_FIELDS = (
    "model_type",
    "num_hidden_layers",
    "num_nextn_predict_layers",
    "linear_attn_config",
    "q_lora_rank",
    "mla_use_nope",
    "mla_use_output_gate",
    "first_k_dense_replace",
    "num_experts",
    "num_shared_experts",
    "routed_expert_hidden_size",
    "latent_moe_use_norm",
    "hidden_act",
    "attn_res_block_size",
    "tie_word_embeddings",
)


# --------------------------------------------------------------------------------------
# Load the reference files by path (llmcompressor/__init__ is never executed)
# --------------------------------------------------------------------------------------
def _llmc_root() -> str:
    spec = importlib.machinery.PathFinder.find_spec("llmcompressor")
    assert spec is not None, "llmcompressor not installed in this interpreter"
    return os.path.dirname(spec.origin)


def _stub_pkg(name: str, path: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__path__ = [path]
    mod.__package__ = name
    sys.modules[name] = mod
    return mod


def _load(name: str, path: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def load_reference(pkg: str = "k3_reference"):
    """Return (configuration_kimi_k3 module, modeling_kimi_linear module)."""
    if f"{pkg}.modeling_kimi_linear" in sys.modules:
        return sys.modules[f"{pkg}.configuration_kimi_k3"], sys.modules[f"{pkg}.modeling_kimi_linear"]
    root = _llmc_root()
    kdir = os.path.join(root, "modeling", "kimi_k3")
    # The modeling file has one absolute import into llmcompressor:
    #   from llmcompressor.modeling.moe.context import get_calibrate_all_experts_flag
    # Stub the three parent packages (no __init__ runs) and load the stdlib-only context.py.
    if "llmcompressor" not in sys.modules:
        _stub_pkg("llmcompressor", root)
        _stub_pkg("llmcompressor.modeling", os.path.join(root, "modeling"))
        _stub_pkg("llmcompressor.modeling.moe", os.path.join(root, "modeling", "moe"))
        _load("llmcompressor.modeling.moe.context", os.path.join(root, "modeling", "moe", "context.py"))
    _stub_pkg(pkg, kdir)  # synthetic package for `from .configuration_kimi_k3 import ...`
    cfg = _load(f"{pkg}.configuration_kimi_k3", os.path.join(kdir, "configuration_kimi_k3.py"))
    mdl = _load(f"{pkg}.modeling_kimi_linear", os.path.join(kdir, "modeling_kimi_linear.py"))
    return cfg, mdl


# --------------------------------------------------------------------------------------
# The folder as the release reads it
# --------------------------------------------------------------------------------------
def _mtp_name(name: str, prefix: str, n_layers: int) -> bool:
    m = re.match(re.escape(prefix) + r"model\.layers\.(\d+)\.", name)
    return m is not None and int(m.group(1)) >= n_layers


def read_flat(folder: str, cfg_mod, mdl) -> tuple[dict, torch.nn.Module, torch.nn.Module, list[str]]:
    """(config, the loaded model, its ``KimiLinearForCausalLM``, names left unloaded) of a flat folder."""
    config = cfg_mod.KimiLinearConfig.from_pretrained(folder)
    kwargs = {}
    if getattr(config, "quantization_config", None) is not None:
        from transformers import CompressedTensorsConfig

        # decompressed on load by compressed-tensors (run_compressed keeps packed weights for GPU kernels)
        kwargs["quantization_config"] = CompressedTensorsConfig(run_compressed=False)
    model, info = mdl.KimiLinearForCausalLM.from_pretrained(
        folder, config=config, dtype=torch.float32, output_loading_info=True, **kwargs
    )
    if info["missing_keys"] or info["mismatched_keys"] or info["error_msgs"]:
        raise SystemExit(f"the release could not load {folder}: {info}")
    unexpected = sorted(info["unexpected_keys"])
    stray = [k for k in unexpected if not _mtp_name(k, "", config.num_hidden_layers)]
    if stray:
        raise SystemExit(f"tensors of {folder} the release does not know (not MTP depths): {stray}")
    return config, model, model, unexpected


def read_multimodal(folder: str, cfg_mod, mdl) -> tuple[dict, torch.nn.Module, torch.nn.Module, list[str]]:
    """(config, the module holding ``language_model``, that ``KimiLinearForCausalLM``, names left
    unloaded) of a folder in the release's multimodal schema."""
    from safetensors.torch import load_file

    config = cfg_mod.KimiK3Config.from_pretrained(folder)
    text = config.text_config
    if getattr(text, "quantization_config", None) is not None:
        raise SystemExit("an MXFP4 multimodal folder is read through compressed-tensors' from_pretrained only")
    holder = torch.nn.Module()  # KimiK3ForConditionalGeneration's text half: its `language_model` attribute
    holder.language_model = mdl.KimiLinearForCausalLM(text).float().eval()
    state = load_file(os.path.join(folder, "model.safetensors"))  # one file: the export shards above 5 GiB
    unexpected = sorted(k for k in state if _mtp_name(k, "language_model.", text.num_hidden_layers))
    for k in unexpected:
        del state[k]
    holder.load_state_dict(state, strict=True)  # every other tensor under its own name, none missing
    return config, holder, holder.language_model, unexpected


def main(folder: str, prompt_path: str, new_tokens: str, out_path: str) -> None:
    install_triton_cpu_shims()
    cfg_mod, mdl = load_reference()
    with open(os.path.join(folder, "config.json")) as f:
        multimodal = "text_config" in json.load(f)
    read = read_multimodal if multimodal else read_flat
    config, top, lm, unloaded = read(folder, cfg_mod, mdl)
    text = config.text_config if multimodal else config
    decompressed = sorted({str(p.dtype) for n, p in lm.named_parameters() if ".experts." in n})
    lm.float().eval()  # compressed-tensors decompresses to bf16, exactly (fp4 values times powers of two)

    prompt = torch.load(prompt_path)  # [1, T]
    with torch.no_grad():
        logits = lm(input_ids=prompt, use_cache=False).logits  # [1, T, V]

    step_lengths: list[int] = []

    def count_positions(module, args, kwargs):
        given = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs["inputs_embeds"]
        step_lengths.append(given.shape[1])

    hook = lm.model.register_forward_pre_hook(count_positions, with_kwargs=True)
    with torch.no_grad():
        out = lm.generate(
            prompt,
            max_new_tokens=int(new_tokens),
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            eos_token_id=None,  # a fixed number of steps: an end-of-text token is compared like any other
        )
    hook.remove()
    config_class = type(config).__name__ + (f" (text_config: {type(text).__name__})" if multimodal else "")
    torch.save(
        {
            "config_class": config_class,
            "config": {k: getattr(text, k, None) for k in DECISION_FIELDS} | {"top_model_type": config.model_type},
            "unloaded": unloaded,
            "loaded": {k: v.detach().float().clone() for k, v in top.state_dict().items()},
            "expert_dtypes": decompressed,
            "cache": type(out.past_key_values).__name__,
            "logits": logits.float(),
            "sequences": out.sequences,
            "step_logits": torch.cat([s.float() for s in out.logits]),  # [new_tokens, V]
            "step_lengths": step_lengths,
        },
        out_path,
    )


if __name__ == "__main__":
    main(*sys.argv[1:5])
