"""Parity with the released K3 modeling code: a tiny K3-shaped model with every K3 decision on (KDA with
the lower-bound gate and full-rank output gate, NoPE MLA with q-LoRA and output gate, dense first layer,
Stable LatentMoE with shared experts, block AttnRes with a partial final block, SiTU-GLU) is exported,
run by the reference code in its own environment, and both give the same logits within fp32 round-off.

Needs the reference environment (tests/reference/setup_reference_env.sh): set K3_REFERENCE_PYTHON to
its python. Skipped otherwise."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

from components.hf.checkpoint import export_weights
from components.hf.config_json import checkpoint_config, write_config
from components.model import Decoder
from runtime.config import to_container
from tests.helpers import compose_root

REFERENCE_PYTHON = os.environ.get("K3_REFERENCE_PYTHON")
pytestmark = pytest.mark.skipif(
    not REFERENCE_PYTHON, reason="K3_REFERENCE_PYTHON not set (tests/reference/setup_reference_env.sh)"
)

# 3 layers: KDA, KDA, MLA; dense first; block AttnRes of 2 layers (a partial final block); no MTP (the
# release has none)
TINY_K3 = [
    "experiment=k3_small",
    "model.d_model=64",
    "model.n_layers=3",
    "model.mtp_depth=0",
    "mixer.n_heads=2",
    "mixer.head_dim=32",
    "mixers.mla.n_heads=2",
    "mixers.mla.q_lora_rank=48",
    "mixers.mla.kv_lora_rank=32",
    "mixers.mla.qk_nope_head_dim=32",
    "mixers.mla.qk_rope_head_dim=16",
    "mixers.mla.v_head_dim=32",
    "ffn.num_experts=8",
    "ffn.top_k=2",
    "ffn.expert_hidden_dim=64",
    "ffn.num_shared_experts=1",
    "ffn.latent_dim=32",
    "ffns.dense.hidden_dim=128",
]


def test_logits_match_the_released_code(tmp_path):
    root = compose_root(*TINY_K3)
    torch.manual_seed(0)
    model = Decoder(root.decoder_config()).eval()
    with torch.no_grad():  # move every tensor off its initial value (zero AttnRes queries, zero bias, unit norms)
        for name, t in model.state_dict().items():
            if t.is_floating_point():
                t.add_(torch.randn_like(t) * (0.3 if "res_proj" in name or "correction_bias" in name else 0.02))
    export_weights(model, str(tmp_path))
    write_config(checkpoint_config(root, model, to_container(root)), str(tmp_path))
    ids = torch.randint(0, 257, (1, 80), generator=torch.Generator().manual_seed(1))  # crosses a 64-token chunk
    torch.save(ids, tmp_path / "ids.pt")
    script = os.path.join(os.path.dirname(__file__), "release_forward.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [REFERENCE_PYTHON, script, str(tmp_path), str(tmp_path / "ids.pt"), str(tmp_path / "ref.pt")],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref = torch.load(tmp_path / "ref.pt")
    with torch.no_grad():
        ours = model(ids).float()
    diff = (ours - ref).abs().max().item()
    print(f"largest logit difference {diff:.3e} (logits up to {ref.abs().max().item():.2f})")
    assert diff < 1e-4 * max(1.0, ref.abs().max().item())
