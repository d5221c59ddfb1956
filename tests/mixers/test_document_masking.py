"""Document masking (packed sequences): with ``segments`` no token sees another document, for every
registered mixer (found through the registry) under every residual scheme; the chunked KDA kernel with
state resets equals the token recurrence with resets; ``Segments`` and its helpers."""

from __future__ import annotations

import pytest
import torch

from components.nn.build_context import BuildContext
from components.nn.segments import Segments
from components.ops.kda import chunk_kda, kda_gate, l2norm, recurrent_kda
from components.registry import MIXERS
from tests.helpers import tiny_model

EOD = 0
T = 40
# EOD positions per row: documents of 9, 2 (shorter than the conv width), 19 and 10 tokens; then 21,
# 16 and 3. KDA runs on 16-token chunks here, so most documents start mid-chunk.
EODS = ([9, 11, 30], [0, 21, 37])
RESIDUALS = ["plain", "full_attnres", "block_attnres"]


def batch(seed: int) -> torch.Tensor:
    """``[2, T]`` tokens without EOD except at ``EODS``."""
    ids = torch.randint(1, 257, (2, T), generator=torch.Generator().manual_seed(seed))
    for row, cuts in enumerate(EODS):
        ids[row, cuts] = EOD
    return ids


def documents(segments: Segments) -> list[tuple[int, torch.Tensor]]:
    """(row, bool mask [T] of its positions) for every document of the batch."""
    return [(b, segments.ids[b] == j) for b in range(segments.shape[0]) for j in segments.ids[b].unique()]


def model_for(name: str, residual: str):
    extra = ["mixer.chunk_size=16"] if name == "kda" else []
    return tiny_model(f"mixer={name}", f"residual={residual}", *extra)


def alone_tol(model) -> float:
    # RoPE tables are fp32 (components/nn/rope.py): a document moved to position 0 rotates by other
    # fp32-rounded angles; everything else is fp64 and position-free
    return 1e-8 if getattr(model.layers[0].mixer.cfg, "rope", False) else 1e-12


@pytest.mark.parametrize("residual", RESIDUALS)
@pytest.mark.parametrize("name", MIXERS.names())
def test_documents_do_not_see_each_other(name, residual):
    model = model_for(name, residual)
    ids = batch(0)
    segments = Segments.from_eod(ids, EOD)
    with torch.no_grad():
        out = model(ids, segments=segments)  # [2, T, vocab]
        for row, pos in documents(segments):
            # every token of every other document changed (EODs stay, so the segments are the same)
            other = batch(1)
            other[row, pos] = ids[row, pos]
            changed = Segments.from_eod(other, EOD)
            assert torch.equal(changed.ids, segments.ids)
            torch.testing.assert_close(model(other, segments=changed)[row, pos], out[row, pos], rtol=0, atol=1e-12)
            # the document as its own row, from position 0, without segments
            alone = model(ids[row : row + 1, pos])[0]
            torch.testing.assert_close(alone, out[row, pos], rtol=0, atol=alone_tol(model))


@pytest.mark.parametrize("name", MIXERS.names())
def test_one_document_per_row_equals_no_segments(name):
    model = model_for(name, "plain")
    ids = batch(0)
    single = Segments(torch.zeros_like(ids))
    with torch.no_grad():
        torch.testing.assert_close(model(ids, segments=single), model(ids), rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", MIXERS.names())
def test_gradients_stay_in_their_document(name):
    model = model_for(name, "block_attnres")
    ids = batch(0)
    segments = Segments.from_eod(ids, EOD)
    embedded = {}

    def keep_output(module, args, out):
        out.retain_grad()
        embedded["x"] = out

    handle = model.embed.register_forward_hook(keep_output)
    try:
        out = model(ids, segments=segments)
    finally:
        handle.remove()
    row, pos = documents(segments)[2]  # row 0, tokens 11..29
    (out[row, pos] * torch.randn_like(out[row, pos])).sum().backward()
    grad = embedded["x"].grad  # [2, T, d]
    outside = torch.ones_like(grad[..., 0], dtype=torch.bool)
    outside[row, pos] = False
    assert grad[outside].abs().max() == 0
    assert grad[row, pos].abs().amin(dim=-1).gt(0).all()  # every token of the document counts


def test_activation_checkpointing_passes_segments():
    ids = batch(0)
    segments = Segments.from_eod(ids, EOD)
    grads = []
    for checkpointing in (False, True):
        model = model_for("kda", "plain").train()
        model.set_activation_checkpointing(checkpointing)
        model(ids, segments=segments).square().mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, rtol=0, atol=1e-14, msg=n)


def test_segments_with_a_decoding_cache_or_of_another_shape_are_refused():
    model = model_for("kda", "plain")
    ids = batch(0)
    with pytest.raises(ValueError, match="segments"):
        model(ids, segments=Segments.from_eod(ids[:, :-1], EOD))
    for name in ("kda", "gqa", "mla"):
        with pytest.raises(ValueError, match="decoding"):
            model_for(name, "plain")(ids, cache=model.new_cache(), segments=Segments.from_eod(ids, EOD))


# -- the KDA kernels with state resets -----------------------------------------------------------
def kda_inputs(B: int, T: int, gate: str, seed: int = 0, H: int = 2, K: int = 8):
    gen = torch.Generator().manual_seed(seed)
    d = torch.float64

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=d)

    q, k, v = l2norm(rnd(B, T, H, K)), l2norm(rnd(B, T, H, K)), rnd(B, T, H, K)
    g = (
        kda_gate(rnd(B, T, H, K), None, None, lower_bound=-1.0)
        if gate == "mild"
        else torch.full((B, T, H, K), -5.0, dtype=d)
    )
    return q, k, v, g, torch.sigmoid(rnd(B, T, H))


def cuts_to_ids(T: int, cuts: list[list[int]]) -> torch.Tensor:
    ids = torch.zeros(len(cuts), T, dtype=torch.long)
    for row, starts in enumerate(cuts):
        for c in starts:
            ids[row, c:] += 1
    return ids


@pytest.mark.parametrize("chunk_size", [16, 32, 64])
@pytest.mark.parametrize(
    "gate,cuts",
    [
        ("mild", [[5, 7, 40, 113], [17, 18, 19, 60]]),  # short documents: aligned to 16 tokens
        ("mild", [[70], [33]]),  # long documents: aligned to the chunk size, several chunks each
        ("bound", [[70], [1, 100]]),  # the kernel halves its chunks below the alignment
    ],
)
@pytest.mark.parametrize("kernel", ["auto", "batched"])  # auto: the native CPU kernel
def test_chunked_kda_with_resets_equals_the_recurrence(kernel, chunk_size, gate, cuts):
    T = 130
    segments = Segments(cuts_to_ids(T, cuts))
    inputs = kda_inputs(2, T, gate, seed=chunk_size)
    xs = [x.clone().requires_grad_() for x in inputs]
    ys = [x.clone().requires_grad_() for x in inputs]
    o, S = chunk_kda(*xs, chunk_size=chunk_size, output_final_state=True, segments=segments, kernel=kernel)
    o_ref, S_ref = recurrent_kda(*ys, output_final_state=True, segments=segments)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(S, S_ref, rtol=0, atol=1e-12)
    gen = torch.Generator().manual_seed(1)
    do, dS = torch.randn(o.shape, generator=gen, dtype=o.dtype), torch.randn(S.shape, generator=gen, dtype=S.dtype)
    ((o * do).sum() + (S * dS).sum()).backward()
    ((o_ref * do).sum() + (S_ref * dS).sum()).backward()
    for name, x, y in zip(["q", "k", "v", "g", "beta"], xs, ys):
        torch.testing.assert_close(x.grad, y.grad, rtol=0, atol=1e-11, msg=name)


def test_recurrence_with_resets_is_the_recurrence_per_document():
    T = 30
    segments = Segments(cuts_to_ids(T, [[4, 12]]))
    q, k, v, g, beta = kda_inputs(1, T, "mild")
    o, S = recurrent_kda(q, k, v, g, beta, output_final_state=True, segments=segments)
    for start, end in ((0, 4), (4, 12), (12, T)):
        part = [x[:, start:end] for x in (q, k, v, g, beta)]
        o_doc, S_doc = recurrent_kda(*part, output_final_state=True)
        torch.testing.assert_close(o[:, start:end], o_doc, rtol=0, atol=1e-14)
    torch.testing.assert_close(S, S_doc, rtol=0, atol=1e-14)


def test_kda_ops_refuse_an_initial_state_with_segments():
    q, k, v, g, beta = kda_inputs(1, 20, "mild")
    segments = Segments(torch.zeros(1, 20, dtype=torch.long))
    S0 = torch.zeros(1, 2, 8, 8, dtype=torch.float64)
    for op in (chunk_kda, recurrent_kda):
        with pytest.raises(ValueError, match="initial_state"):
            op(q, k, v, g, beta, initial_state=S0, segments=segments)


# -- Segments ---------------------------------------------------------------------------------------
def test_segments_helpers():
    ids = torch.tensor([[7, 1, 0, 2, 2, 0], [0, 3, 4, 5, 0, 0]])
    seg = Segments.from_eod(ids, 0)
    assert seg.ids.tolist() == [[0, 0, 1, 1, 1, 2], [1, 1, 1, 1, 2, 3]]
    assert seg.starts.tolist() == [[True, False, True, False, False, True], [True, False, False, False, True, True]]
    assert seg.cu_seqlens().tolist() == [0, 2, 5, 6, 10, 11, 12]
    mask = seg.attention_mask()  # [B, 1, T, T]
    assert mask.shape == (2, 1, 6, 6)
    assert mask[0, 0].long().tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 0, 1, 0, 0, 0],
        [0, 0, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],
    ]
    assert seg.same_segment_as_shifted(1)[..., 0].tolist() == [
        [False, True, False, True, True, False],
        [False, True, True, True, False, False],
    ]
    assert not seg.same_segment_as_shifted(9).any()
    assert seg.attention_mask() is mask  # built once per batch


def test_packing_aligns_every_document_and_bounds_the_padding():
    T = 100
    seg = Segments(cuts_to_ids(T, [[3, 40, 41], [64]]))
    long_docs = seg.packing(64, 16)
    assert long_docs.align == 16  # 64-token alignment would more than double the first row
    short = Segments(cuts_to_ids(T, [[50], [64]])).packing(64, 16)
    assert short.align == 64 and short.length == 128
    for packing, segments in ((long_docs, seg), (short, Segments(cuts_to_ids(T, [[50], [64]])))):
        x = torch.arange(2 * T, dtype=torch.float64).view(2, T, 1)
        packed = packing.pack(x)  # [2, length, 1]
        assert torch.equal(packing.unpack(packed, T), x)
        assert packed.shape[1] == packing.length and packing.length % packing.align == 0
        where = packing.starts.nonzero()
        assert (where[:, 1] % packing.align == 0).all()  # every document starts on the alignment
        assert packing.starts.sum() == segments.starts.sum()
        assert packed.abs().sum() == x.sum()  # zeros between documents


def test_mla_absorbed_order_masks_documents_too():
    model = model_for("mla", "plain")
    mixer = model.layers[0].mixer
    x = torch.randn(2, T, model.d_model, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    segments = Segments.from_eod(batch(0), EOD)
    expanded = mixer(x, segments=segments, order="expanded")
    torch.testing.assert_close(mixer(x, segments=segments, order="absorbed"), expanded, rtol=0, atol=1e-12)
    row, pos = documents(segments)[2]
    torch.testing.assert_close(
        mixer(x[row : row + 1, pos], order="absorbed")[0], expanded[row, pos], rtol=0, atol=1e-12
    )


@pytest.mark.parametrize(
    "mode,overrides",
    [
        ("layers", ["experiment=k3_tiny", "model.n_layers=2"]),  # KDA (eager island inside) then MLA, routed FFN
        ("model", ["model=tiny"]),  # GQA: the whole decoder as one graph
    ],
)
def test_compiled_decoder_with_segments_equals_eager_without_recompiling(mode, overrides):
    import torch._dynamo
    from torch._dynamo.utils import counters

    from components.model import Decoder
    from runtime.compile import compiled_hidden
    from tests.helpers import compose_root

    torch.manual_seed(0)
    model = Decoder(compose_root(*overrides).decoder_config())
    batches = [batch(i) for i in range(3)]
    for i, ids in enumerate(batches):  # documents at other places in every batch
        ids[0, 3 + 5 * i] = EOD
    eager = [model.hidden_states(ids, segments=Segments.from_eod(ids, EOD)) for ids in batches]
    torch._dynamo.reset()
    hidden = compiled_hidden(model, mode, backend="aot_eager")
    frames = []
    for ids, ref in zip(batches, eager):
        out = hidden(ids, segments=Segments.from_eod(ids, EOD))
        out.square().mean().backward()
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        frames.append(counters["frames"]["total"])
    assert frames[0] > 0 and frames[1] == frames[2] == frames[0]  # compiled once, not per document layout


@pytest.mark.gpu
def test_kda_fla_varlen_matches_torch_on_gpu():
    from components.mixers.kda import KDAConfig, KimiDeltaAttention

    torch.manual_seed(0)
    mixer = KimiDeltaAttention(KDAConfig(n_heads=3, head_dim=16, backend="torch"), BuildContext(48)).cuda()
    x = torch.randn(2, 300, 48, device="cuda")
    segments = Segments(cuts_to_ids(300, [[5, 7, 150, 299], [64, 65, 200]]).cuda())
    results = {}
    for backend in ("torch", "fla"):
        mixer.cfg.backend = backend
        mixer.zero_grad()
        y = mixer(x, segments=segments)
        y.square().sum().backward()
        results[backend] = (y.detach(), {n: p.grad.clone() for n, p in mixer.named_parameters()})
    y_ref, g_ref = results["torch"]
    torch.testing.assert_close(results["fla"][0], y_ref, rtol=2e-2, atol=2e-2)
    for n, g in g_ref.items():
        torch.testing.assert_close(results["fla"][1][n], g, rtol=5e-2, atol=5e-2, msg=n)
