"""Run the released K3 modeling code (the copy of ``modeling_kimi_linear.py`` the ``llmcompressor``
package ships) on an exported checkpoint folder, on the CPU in fp32, and save its logits.

    REFERENCE_PYTHON tests/reference/release_forward.py FOLDER IDS.pt LOGITS.pt

Runs under the reference environment (tests/reference/setup_reference_env.sh), not the project's: the
package pins its own torch/transformers ranges. Its files are loaded by path (the package's own
``__init__`` pulls in a heavy stack). Its KDA layers call fla's Triton kernels, run here by the Triton
interpreter (``TRITON_INTERPRET=1``) with the runtime shims of ``triton_shims.py`` (``install_triton_cpu_shims``).
"""

from __future__ import annotations

import os

# Must be set before `triton` is first imported (triton.jit reads it at decoration time).
os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("OMP_NUM_THREADS", "1")

import importlib.machinery  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import types  # noqa: E402

import torch  # noqa: E402

torch.set_num_threads(1)

# the interpreter shims, shared with the project's kernel checks (run as a script, this folder is on sys.path)
from triton_shims import install_triton_cpu_shims  # noqa: E402  (after TRITON_INTERPRET is set)


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


def text_config(cfg: dict) -> dict:
    """The text model's fields of an exported config.json (the project's own section dropped)."""
    return {k: v for k, v in cfg.items() if k not in ("k3_sandbox", "architectures", "torch_dtype")}


def main(folder: str, ids_path: str, out_path: str) -> None:
    from safetensors.torch import load_file

    install_triton_cpu_shims()
    cfg_mod, mdl = load_reference()
    with open(os.path.join(folder, "config.json")) as f:
        cfg = (
            mdl.KimiLinearConfig(**text_config(json.load(f)))
            if hasattr(mdl, "KimiLinearConfig")
            else cfg_mod.KimiLinearConfig(**text_config(json.load(f)))
        )
    model = mdl.KimiLinearForCausalLM(cfg).float().eval()
    state = load_file(os.path.join(folder, "model.safetensors"))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise SystemExit(f"reference model and export disagree: missing {missing}, unexpected {unexpected}")
    ids = torch.load(ids_path)
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
    torch.save(logits.float(), out_path)


if __name__ == "__main__":
    main(*sys.argv[1:4])
