"""Triton's interpreter (``TRITON_INTERPRET=1``) patched to run fla-core's kernels on CPU tensors: the one
place every such shim lives (the released reference's forward, tests/reference/release_reader.py, and the
kernel parity checks, tests/benchmarks/test_gpu_check_rehearsal.py, install them).

Import this module only in a process started with ``TRITON_INTERPRET=1`` (``triton.jit`` reads it when a
kernel is defined, so it must be set before fla or triton is imported); ``install_triton_cpu_shims()``
then patches, once per process, what differs between compiled Triton and its interpreter:

1. the autotuner: the interpreter has no benchmarker, so no config is timed (all tie; the first is used);
2. loop counters: compiled Triton makes ``range`` / ``tl.range`` induction variables int32 tensors (fla calls
   ``i_t.to(tl.int64)`` on them); the interpreter yields Python ints;
3. ``tl.dot`` on bf16/fp16 operands: the interpreter stores bf16 as uint16 and ``np.matmul`` would multiply
   the raw bits (fla's bf16 backward then gives k/g/beta gradients about 1e4x too large); upcast to fp32;
4. ``tl.gather`` aliased at module level by fla (``gather = tl.gather``): the interpreter patches only builtins
   reached through ``tl``, so a thin jitted wrapper takes the alias's place;
5. ``tl.dot(..., input_precision="bf16x3")`` (fla's bounded-gate KDA path, ``safe_gate=True``): the
   interpreter accepts only tf32 / tf32x3 / ieee; it multiplies in fp32 whatever the precision, which is
   what bf16x3 (three bf16 passes) approximates, so the option is allowed as is;
6. fla's AttnRes forward refuses tensors that are not on CUDA (``fused_attnres_fwd``); its kernels run on CPU
   tensors under the interpreter, so the check is dropped;
7. arithmetic on bf16 values, elementwise (``+ - * /``, ``exp``, ``fma``, clamps) and in the numpy fast
   paths of reductions and scans (``tl.sum``, ``tl.max`` / ``tl.min``, ``tl.cumsum``; compiled Triton
   computes them in fp32 and rounds the result to bf16): on the interpreter's raw uint16 bits numpy adds and
   multiplies the bit patterns, which gives fla's bf16 KDA backward k/g/beta gradients about 1e4x too large
   (and NaN gate gradients) once a sequence spans several chunks; the operands are widened to fp32 and the
   result rounded back (to nearest even), as on a GPU.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import os
import textwrap

if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    raise RuntimeError("tests.reference.triton_shims needs TRITON_INTERPRET=1 set before triton is imported")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _k3ref_gather(src, index, axis):
    # shim 4: module level, where the interpreter finds triton.language in the function's globals
    return tl.gather(src, index, axis)


_SHIMS_DONE = False


def install_triton_cpu_shims() -> None:
    global _SHIMS_DONE
    if _SHIMS_DONE:
        return
    import numpy as np
    from triton.runtime import autotuner
    from triton.runtime import interpreter as interp

    # (1) autotuner: never time configs; all tie at 0.0, so the first (pruned) config is used
    autotuner.Autotuner._bench = lambda self, *a, config, **k: [0.0, 0.0, 0.0]

    # (2) loop counters as int32 tensors: rewrite the iterators of `range` / `tl.range` loops (not
    #     tl.static_range, whose counter is a constexpr)
    def _k3ref_int_iter(it):
        for v in it:
            yield interp._implicit_cvt(v) if isinstance(v, int) else v

    interp._k3ref_int_iter = _k3ref_int_iter  # copied into kernel globals by the rewriter

    def _visit_for(self, node):
        self.generic_visit(node)
        f = node.iter.func if isinstance(node.iter, ast.Call) else None
        name = f.id if isinstance(f, ast.Name) else (f.attr if isinstance(f, ast.Attribute) else None)
        if name == "range":
            node.iter = ast.Call(func=ast.Name(id="_k3ref_int_iter", ctx=ast.Load()), args=[node.iter], keywords=[])
        return node

    interp.ASTTransformer.visit_For = _visit_for

    # (3) tl.dot on bf16/fp16 operands: upcast the stored bits to fp32 before np.matmul
    _orig_dot = interp.InterpreterBuilder.create_dot

    def up(h):
        if h.dtype == tl.bfloat16:
            data = (h.data.astype(np.uint32) << 16).view(np.float32)
            return interp.TensorHandle(data, tl.float32)
        if h.dtype == tl.float16:
            return interp.TensorHandle(h.data.astype(np.float32), tl.float32)
        return h

    def _create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return _orig_dot(self, up(a), up(b), d, input_precision, max_num_imprecise_acc)

    interp.InterpreterBuilder.create_dot = _create_dot

    # (7) bf16 elementwise arithmetic in fp32, rounded back to bf16
    def widen(h):
        return interp.TensorHandle(up(h).data, tl.float32) if h.dtype.scalar == tl.bfloat16 else h

    def round_bf16(h):
        bits = h.data.astype(np.float32).view(np.uint32)
        bits = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
        return interp.TensorHandle(bits.astype(np.uint16), tl.bfloat16)

    def in_fp32(orig):
        def op(self, *args):
            handles = [a for a in args if isinstance(a, interp.TensorHandle)]
            if not any(h.dtype.scalar == tl.bfloat16 for h in handles):
                return orig(self, *args)
            out = orig(self, *(widen(a) if isinstance(a, interp.TensorHandle) else a for a in args))
            return round_bf16(out) if out.dtype.scalar == tl.float32 and out.data.dtype == np.float32 else out

        return op

    for name in ("binary_op", "unary_op", "ternary_op", "create_fma"):
        setattr(interp.InterpreterBuilder, name, in_fp32(getattr(interp.InterpreterBuilder, name)))

    def reduce_in_fp32(orig):
        def op(self, input, *args, **kwargs):
            if input.dtype.scalar != tl.bfloat16:
                return orig(self, input, *args, **kwargs)
            wide = tl.core.tensor(widen(input.handle), tl.block_type(tl.float32, input.shape))
            outs = orig(self, wide, *args, **kwargs)
            single = not isinstance(outs, (list, tuple))
            outs = [outs] if single else list(outs)
            for i, t in enumerate(outs):
                if t.dtype.scalar == tl.float32:  # the values (an argmax's indices stay int32)
                    outs[i] = tl.core.tensor(round_bf16(t.handle), tl.block_type(tl.bfloat16, t.shape))
            return outs[0] if single else (tuple(outs) if isinstance(outs, tuple) else outs)

        return op

    interp.ReduceOps.sum = reduce_in_fp32(interp.ReduceOps.sum)
    interp.ReduceOps.min_max = reduce_in_fp32(interp.ReduceOps.min_max)
    interp.ScanOps.cumsum = reduce_in_fp32(interp.ScanOps.cumsum)
    interp.ScanOps.cumprod = reduce_in_fp32(interp.ScanOps.cumprod)

    # (4) fla's module-level `gather = tl.gather` aliases
    import fla.ops.utils.op as fla_op

    fla_op.gather = _k3ref_gather
    for modname in ("fla.ops.kda.chunk_intra",):
        importlib.import_module(modname).gather = _k3ref_gather

    # (5) bf16x3 among the dot precisions the interpreter accepts (its one builder's options)
    builder = interp.interpreter_builder
    allowed = tuple(builder.options.allowed_dot_input_precisions)
    if "bf16x3" not in allowed:  # (a later Triton may accept it already)
        builder.options = dataclasses.replace(builder.options, allowed_dot_input_precisions=(*allowed, "bf16x3"))

    # (6) fla's AttnRes forward without its CUDA-only check (the source re-executed in its own module)
    fused = importlib.import_module("fla.ops.attnres.fused")
    source = textwrap.dedent(inspect.getsource(fused.fused_attnres_fwd))
    check = '    if not residuals[0].is_cuda:\n        raise ValueError("Triton attnres requires CUDA tensors")\n'
    if check not in source:
        raise RuntimeError("fla's fused_attnres_fwd changed: shim 6 no longer applies")
    exec(compile(source.replace(check, ""), fused.__file__, "exec"), fused.__dict__)
    _SHIMS_DONE = True
