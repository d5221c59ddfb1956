"""Scratch driver: run the released Kimi K3 text model (llmcompressor 0.14.0.1's copy of
modeling_kimi_linear.py) on a 2-core CPU, fp32, with fla's Triton kernels executed by the
Triton interpreter (TRITON_INTERPRET=1) plus four runtime shims.

Run with /work/refenv/bin/python (NOT the project venv):
    OMP_NUM_THREADS=1 /work/refenv/bin/python tests/reference/_scratch_ref_forward.py
Writes /tmp/k3_ref_keys.txt and /tmp/k3_ref_config.json. Scratch file; may be rewritten.
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
import math  # noqa: E402
import sys  # noqa: E402
import types  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

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
            node.iter = ast.Call(func=ast.Name(id="_k3ref_int_iter", ctx=ast.Load()),
                                 args=[node.iter], keywords=[])
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


# --------------------------------------------------------------------------------------
# Tiny config with every K3 decision on
# --------------------------------------------------------------------------------------
TINY_TEXT_CONFIG = dict(
    model_type="kimi_linear",
    vocab_size=300,
    hidden_size=64,
    head_dim=32,
    intermediate_size=128,            # dense layer-0 MLP
    num_hidden_layers=3,
    num_attention_heads=2,
    num_key_value_heads=2,
    hidden_act="situ",                # SiTU-GLU
    activation_situ_beta=4.0,         # release value
    activation_situ_linear_beta=25.0, # release value
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    max_position_embeddings=4096,
    # MLA: NoPE, q-LoRA, output gate
    q_lora_rank=48,
    kv_lora_rank=32,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,              # still present under NoPE (release: 64); k_rot is unrotated
    v_head_dim=32,
    mla_use_nope=True,
    mla_use_output_gate=True,
    # Stable LatentMoE + shared experts
    num_experts=8,
    num_experts_per_token=2,
    num_shared_experts=1,
    moe_intermediate_size=32,
    routed_expert_hidden_size=32,     # latent = hidden/2
    latent_moe_use_norm=True,
    moe_renormalize=True,
    moe_router_activation_func="sigmoid",
    routed_scaling_factor=1.0,        # release value
    first_k_dense_replace=1,
    moe_layer_freq=1,
    use_grouped_topk=True,
    num_expert_group=1,
    topk_group=1,
    topk_method="noaux_tc",
    num_nextn_predict_layers=0,       # stored only; the reference builds no MTP module
    # Block AttnRes: 3 layers, block size 2 -> blocks {0,1},{2} (partial final block)
    attn_res_block_size=2,
    # KDA (layer lists are 1-based)
    linear_attn_config=dict(
        kda_layers=[1, 2],
        full_attn_layers=[3],
        num_heads=2,
        head_dim=32,
        short_conv_kernel_size=4,
        gate_lower_bound=-5.0,
        use_full_rank_gate=True,
    ),
)


def build_tiny(seed: int = 0, dtype=torch.float32):
    cfgmod, mdl = load_reference()
    cfg = cfgmod.KimiLinearConfig(**TINY_TEXT_CONFIG)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = mdl.KimiLinearForCausalLM(cfg)
    # The reference's _init_weights is a no-op and several params are torch.empty
    # (dt_bias, e_score_correction_bias): initialise everything explicitly.
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.empty(p.shape).uniform_(1, 16, generator=g)))
            elif name.endswith("dt_bias") or name.endswith("e_score_correction_bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif p.ndim == 1:   # RMSNorm weights
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    return cfg, model.to(dtype).eval()


# --------------------------------------------------------------------------------------
# Pure-torch oracle for KimiDeltaAttention (no mask, no cache) -- validates the kernels
# --------------------------------------------------------------------------------------
def torch_kda_forward(self, hidden_states, attention_mask=None, cache_params=None, **kw):
    from fla.ops.kda.naive import naive_recurrent_kda
    assert attention_mask is None and cache_params is None
    B, T, _ = hidden_states.shape
    H, D = self.num_heads, self.head_dim
    x = hidden_states

    def conv(lin, conv_mod):
        y = lin(x).transpose(1, 2)                                  # [B, C, T]
        w = conv_mod.weight                                         # [C, 1, K]
        y = F.conv1d(F.pad(y, (w.shape[-1] - 1, 0)), w, groups=w.shape[0])
        return F.silu(y).transpose(1, 2)

    q = conv(self.q_proj, self.q_conv1d).view(B, T, H, D).float()
    k = conv(self.k_proj, self.k_conv1d).view(B, T, H, D).float()
    v = conv(self.v_proj, self.v_conv1d).view(B, T, H, D).float()
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    graw = self.f_b_proj(self.f_a_proj(x)).view(B, T, H, D).float() + self.dt_bias.view(H, D).float()
    A = self.A_log.float().exp().view(H, 1)
    if self.gate_lower_bound is not None:
        g = self.gate_lower_bound * torch.sigmoid(A * graw)
    else:
        g = -A * F.softplus(graw)
    beta = torch.sigmoid(self.b_proj(x).float())
    o, _ = naive_recurrent_kda(q, k, v, g, beta, scale=D ** -0.5)
    gate = (self.g_proj(x) if self.use_full_rank_gate else self.g_b_proj(self.g_a_proj(x))).view(B, T, H, D)
    of = o.float()
    of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + self.o_norm.eps) * self.o_norm.weight.float()
    of = of * torch.sigmoid(gate.float())
    return self.o_proj(of.to(x.dtype).reshape(B, T, H * D))


def dump_keys(model, path="/tmp/k3_ref_keys.txt"):
    lines = [f"{k}\t{tuple(v.shape)}\t{v.dtype}" for k, v in model.state_dict().items()]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return lines


def main():
    install_triton_cpu_shims()
    cfg, model = build_tiny()
    _, mdl = load_reference()
    lines = dump_keys(model)
    print(f"{len(lines)} state-dict keys -> /tmp/k3_ref_keys.txt")
    with open("/tmp/k3_ref_config.json", "w") as f:
        f.write(cfg.to_json_string(use_diff=False))
    T = 16
    ids = torch.randint(0, cfg.vocab_size, (1, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        # (a) reference path: chunk_kda + ShortConvolution + FusedRMSNormGated Triton kernels, interpreted
        ref = model(input_ids=ids, use_cache=False).logits
        print("forward (chunk_kda, interpreted):", tuple(ref.shape), "finite:", bool(ref.isfinite().all()))
        # (b) decode path: prefill T-1 with cache (chunk mode), then 1 token -> fused_recurrent_kda
        out = model(input_ids=ids[:, :-1], use_cache=True)
        step = model(input_ids=ids[:, -1:], past_key_values=out.past_key_values, use_cache=True).logits
        print("decode step (fused_recurrent_kda) max|diff| vs full forward:",
              (step[:, -1] - ref[:, -1]).abs().max().item())
        # (c) pure-torch oracle for KDA
        orig = mdl.KimiDeltaAttention.forward
        mdl.KimiDeltaAttention.forward = torch_kda_forward
        try:
            oracle = model(input_ids=ids, use_cache=False).logits
        finally:
            mdl.KimiDeltaAttention.forward = orig
        print("torch-oracle KDA max|diff| vs interpreted kernels:", (oracle - ref).abs().max().item(),
              " (logit scale", ref.abs().max().item(), ")")
    return ref


if __name__ == "__main__":
    main()
