"""Run the released K3 modeling code (the copy of ``modeling_kimi_linear.py`` the ``llmcompressor``
package ships) on an exported checkpoint folder, on the CPU in fp32, and save its logits.

    REFERENCE_PYTHON tests/reference/release_forward.py FOLDER IDS.pt LOGITS.pt

Runs under the reference environment (tests/reference/setup_reference_env.sh), not the project's: the
package pins its own torch/transformers ranges. Its files are loaded by path (the package's own
``__init__`` pulls in a heavy stack). Its KDA layers call fla's Triton kernels, run here by the Triton
interpreter (``TRITON_INTERPRET=1``) with four runtime shims (``install_triton_cpu_shims``).
"""

from __future__ import annotations

import os

# Must be set before `triton` is first imported (triton.jit reads it at decoration time).
os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("OMP_NUM_THREADS", "1")

import ast  # noqa: E402
import importlib.machinery  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import types  # noqa: E402

import torch  # noqa: E402

torch.set_num_threads(1)

import triton  # noqa: E402  (after TRITON_INTERPRET is set)
import triton.language as tl  # noqa: E402


@triton.jit
def _k3ref_gather(src, index, axis):
    return tl.gather(src, index, axis)


# --------------------------------------------------------------------------------------
# Triton interpreter shims (CPU execution of fla's kernels)
# --------------------------------------------------------------------------------------
_SHIMS_DONE = False


def install_triton_cpu_shims() -> None:
    global _SHIMS_DONE
    if _SHIMS_DONE:
        return
    import numpy as np
    from triton.runtime import autotuner
    from triton.runtime import interpreter as interp

    # (1) Autotuner: the interpreter has no driver/benchmarker -> never time configs.
    #     All configs tie at 0.0, so the first (pruned) config is used.
    autotuner.Autotuner._bench = lambda self, *a, config, **k: [0.0, 0.0, 0.0]

    # (2) Loop counters: compiled Triton makes `for i in range(..)` / `tl.range(..)`
    #     induction variables int32 tensors (fla calls `i_t.to(tl.int64)` on them);
    #     the interpreter yields Python ints. Rewrite those loops' iterators.
    def _k3ref_int_iter(it):
        for v in it:
            yield interp._implicit_cvt(v) if isinstance(v, int) else v

    interp._k3ref_int_iter = _k3ref_int_iter  # copied into kernel globals by the rewriter

    def _visit_for(self, node):
        self.generic_visit(node)
        f = node.iter.func if isinstance(node.iter, ast.Call) else None
        name = f.id if isinstance(f, ast.Name) else (f.attr if isinstance(f, ast.Attribute) else None)
        if name == "range":  # builtin range and tl.range; NOT tl.static_range (constexpr)
            node.iter = ast.Call(func=ast.Name(id="_k3ref_int_iter", ctx=ast.Load()), args=[node.iter], keywords=[])
        return node

    interp.ASTTransformer.visit_For = _visit_for

    # (3) tl.dot on bf16/fp16 operands: bf16 is stored as uint16 in the interpreter and
    #     np.matmul would multiply the raw bits. Upcast to fp32 first.
    _orig_dot = interp.InterpreterBuilder.create_dot

    def _create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        def up(h):
            if h.dtype == tl.bfloat16:
                data = (h.data.astype(np.uint32) << 16).view(np.float32)
                return interp.TensorHandle(data, tl.float32)
            if h.dtype == tl.float16:
                return interp.TensorHandle(h.data.astype(np.float32), tl.float32)
            return h

        return _orig_dot(self, up(a), up(b), d, input_precision, max_num_imprecise_acc)

    interp.InterpreterBuilder.create_dot = _create_dot

    # (4) fla aliases `gather = tl.gather` at module level; the interpreter only patches
    #     builtins reached through the `tl` module, so re-jit a thin wrapper.
    # The wrapper lives at module level (_k3ref_gather) because the interpreter requires
    # `triton.language` to be visible in the jitted function's globals.
    _gather = _k3ref_gather
    import fla.ops.utils.op as fla_op

    fla_op.gather = _gather
    for modname in ("fla.ops.kda.chunk_intra",):
        mod = importlib.import_module(modname)
        mod.gather = _gather
    _SHIMS_DONE = True


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
