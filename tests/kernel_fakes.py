"""The kernel paths on a CPU, for tests that look at how they compile: what a GPU run with ``backend=auto``
executes, with CUDA faked where the back-end is resolved and each kernel replaced by its torch reference
at the call that launches it.

* ``fake_cuda``: the ops' ``resolve(op, choice, device, applies)`` sees a CUDA device (the real resolver,
  so whatever it does inside a compiled graph happens here too); the kernels must be importable, as on a
  GPU (fla-core and triton are dependencies).
* ``torch_kernels``: SiTU-GLU's Triton launches (``situ_glu_fwd`` / ``situ_glu_bwd``), fla's AttnRes
  launches (``components.ops.attnres._fla_kernels``) and fla's KDA entry points
  (``components.mixers.kda.fla_kda_kernels``) replaced by torch functions of the same signatures. fla's
  ``chunk_kda`` is ``torch.compiler.disable``'d, so its stand-in is too: a compiled layer breaks there on a
  GPU as well.
* ``count_compiled``: graphs, graph breaks (each with its reason) and captured ops of a model's hidden-state
  function compiled in a ``runtime/compile.py`` mode, with a counting back-end (no kernels generated).
"""

from __future__ import annotations

import importlib
from collections import Counter
from dataclasses import dataclass, field

import torch

CUDA = torch.device("cuda")
# the modules whose ops call components.ops.backend.resolve
RESOLVING_MODULES = ("components.ops.activations", "components.ops.attnres", "components.mixers.kda")
# the break an eager island (torch.compiler.disable) makes, as TorchDynamo words it
ISLAND_BREAK = "torch.compiler.disable()"
# launches of each stand-in kernel since torch_kernels() (they run eagerly, inside their ops or islands)
LAUNCHES: Counter = Counter()


def fake_cuda(monkeypatch) -> None:
    """Every op resolves its back-end as if its tensors were on CUDA."""
    for name in RESOLVING_MODULES:
        module = importlib.import_module(name)
        real = module.resolve
        monkeypatch.setattr(
            module, "resolve", lambda op, choice, device, applies=True, _real=real: _real(op, choice, CUDA, applies)
        )


# -- torch stand-ins of the kernels --------------------------------------------------------------------
def _situ_glu_fwd(gate, up, beta, linear_beta, block=None):
    LAUNCHES["situ_glu"] += 1
    from components.ops.activations import situ_glu_reference

    return situ_glu_reference(gate, up, beta, linear_beta)


def _situ_glu_bwd(grad_z, gate, up, beta, linear_beta, block=None):
    from components.ops.activations import situ_glu_reference

    _, vjp = torch.func.vjp(lambda a, b: situ_glu_reference(a, b, beta, linear_beta), gate, up)
    return vjp(grad_z.to(gate.dtype))


def _attnres_fwd(q, residuals, res, w, ow, eps, scale, checkpoint_level):
    """fla's ``fused_attnres_fwd`` in torch: (o [N, d], o_pre None, rstd [S, N], logit [S, N], lse [N])."""
    LAUNCHES["attnres"] += 1
    u = torch.stack([r.float() for r in residuals])  # [S, N, d]
    rstd = torch.rsqrt(u.square().mean(-1) + eps)  # [S, N]
    logit = (u * (q.float() * w.float())).sum(-1) * rstd  # [S, N]
    lse = torch.logsumexp(logit * scale, dim=0)  # [N]
    p = (logit * scale - lse).exp()  # [S, N]
    return (p.unsqueeze(-1) * u).sum(0).to(residuals[0].dtype), None, rstd, logit, lse


def _attnres_bwd(do, q, residuals, res, w, ow, o_pre, rstd, logit, lse, eps, scale, checkpoint_level):
    """fla's ``fused_attnres_bwd`` in torch: (source grads, dq, dw, dow None)."""

    def read(q_, w_, *srcs):
        return _attnres_fwd(q_, list(srcs), None, w_, None, eps, scale, checkpoint_level)[0]

    _, vjp = torch.func.vjp(read, q, w, *residuals)
    dq, dw, *dsrcs = vjp(do)
    return [g.clone() for g in dsrcs], dq, dw, None  # fresh tensors, as fla's (not views of one stack)


def _attnres_kernels():
    from fla.ops.attnres.fused import _build_ptr_table  # the real table: it asserts 16-byte aligned sources

    return _attnres_fwd, _attnres_bwd, _build_ptr_table


@torch.compiler.disable  # as fla's chunk_kda
def _fla_chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None, **_):
    from components.nn.segments import Segments
    from components.ops.kda import chunk_kda

    LAUNCHES["kda"] += 1
    segments = None
    if cu_seqlens is not None:  # fla's flattened variable-length form: one row cut at every start
        starts = torch.zeros(q.shape[1], dtype=torch.long, device=q.device)
        starts[cu_seqlens[1:-1]] = 1
        segments = Segments(starts.cumsum(0)[None])
    return chunk_kda(q, k, v, g, beta, scale, initial_state, output_final_state=output_final_state, segments=segments)


def _fla_fused_recurrent_kda(q, k, v, g, beta, initial_state=None, output_final_state=False, **_):
    from components.ops.kda import recurrent_kda

    return recurrent_kda(q, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state)


def _kda_kernels():
    return _fla_chunk_kda, _fla_fused_recurrent_kda


def torch_kernels(monkeypatch) -> Counter:
    """Each kernel replaced by its torch reference at the call that launches it; returns ``LAUNCHES``
    (emptied), which counts the launches by kernel (``situ_glu``, ``attnres``, ``kda``)."""
    from components.mixers import kda
    from components.ops import attnres
    from components.ops.triton import situ_glu

    monkeypatch.setattr(situ_glu, "situ_glu_fwd", _situ_glu_fwd)
    monkeypatch.setattr(situ_glu, "situ_glu_bwd", _situ_glu_bwd)
    monkeypatch.setattr(attnres, "_fla_kernels", _attnres_kernels)
    monkeypatch.setattr(kda, "fla_kda_kernels", _kda_kernels)
    LAUNCHES.clear()
    return LAUNCHES


# -- counting what TorchDynamo captures ------------------------------------------------------------------
@dataclass
class Compiled:
    graphs: int
    ops: int
    breaks: list[str] = field(default_factory=list)  # one reason per break (first line)

    @property
    def unintended_breaks(self) -> list[str]:
        """Breaks other than at an eager island."""
        return [r for r in self.breaks if ISLAND_BREAK not in r]


def count_compiled(model: torch.nn.Module, mode: str, *args, **kwargs) -> Compiled:
    """Compile ``model.hidden_states`` in ``mode`` (``model`` or ``layers``, runtime/compile.py) with a
    counting back-end, run it once on ``args``, and count what TorchDynamo captured."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter
    from torch._dynamo.utils import counters

    from runtime.compile import compiled_hidden

    torch._dynamo.reset()
    counters.clear()
    counter = CompileCounter()
    compiled_hidden(model, mode, backend=counter)(*args, **kwargs)
    breaks = [" | ".join(reason.splitlines()[:3]) for reason, n in counters["graph_break"].items() for _ in range(n)]
    result = Compiled(counter.frame_count, counter.op_count, breaks)
    torch._dynamo.reset()
    return result
