"""Parity with the released K3 modeling code along a researcher's path: a tiny K3 with every K3 decision on
is trained a few steps by ``train.py``, exported by ``python -m analysis.export`` three ways (fp32,
``--mxfp4-experts``, ``--prefix multimodal``), and each folder is read by the released code in its own
environment from the folder alone (tests/reference/release_reader.py): its own config class on
``config.json``, a strict load under the folder's own tensor names, compressed-tensors' own decompression
of the MXFP4 experts. Its logits and its own cached ``generate()`` match the project's model within fp32
round-off.

The decisions, all on: KDA with the lower-bound gate (-5) and the full-rank output gate; NoPE MLA with
q-LoRA and the output gate; the 3:1 KDA:MLA plan with a final MLA (5 layers: KDA, KDA, KDA, MLA, MLA, the
last MLA forced by the plan's ``at: {-1: mla}``); a dense SiTU-GLU first FFN; Stable LatentMoE with
shared experts and SiTU-GLU, routed under Quantile Balancing; block AttnRes of 2 layers, so the fifth
layer is a partial final block; one MTP depth.

Where the release and the project legitimately differ, and what is checked instead:

* MTP: the release has no MTP module. Its strict load leaves out exactly the folder's MTP tensors
  (``layers.5.*``, DeepSeek-V3's names), and nothing else; MTP does not enter the logits.
* The flat folder's ``model_type`` is the project's class (``k3_sandbox``): the release's
  ``KimiLinearConfig`` reads the same flat text fields whatever the label (transformers warns about the
  label only), so every K3 field it acts on is checked as it read it.
* The multimodal folder: the release's ``KimiK3Config`` reads it (text fields under ``text_config``);
  ``KimiK3ForConditionalGeneration`` would also build a vision tower from a ``vision_config`` a text-only
  export has none of, so its text half, the ``language_model`` attribute, is loaded under the folder's
  ``language_model.`` names.
* MXFP4: compressed-tensors decompresses the experts to bf16 (exactly: FP4 values times powers of two);
  the project's side is its own dequantisation of the same folder.

Needs the reference environment: ``bash tests/reference/setup_reference_env.sh`` and K3_REFERENCE_PYTHON
set to its python (.ci/run does both). Skipped otherwise, with that reason."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REFERENCE_PYTHON = os.environ.get("K3_REFERENCE_PYTHON")
pytestmark = pytest.mark.skipif(
    not REFERENCE_PYTHON,
    reason="K3_REFERENCE_PYTHON not set (the released code's environment: tests/reference/setup_reference_env.sh)",
)

REPO = Path(__file__).resolve().parents[2]
READER = Path(__file__).resolve().parent / "release_reader.py"

# k3_tiny's sizes (d_model 64, 2 KDA heads of 32, 8 experts of 32, top-2, latent 32) with every decision
# spelled out, so the test does not rest on the experiment's defaults; 5 layers for the final MLA and the
# partial AttnRes block. A few steps move every tensor off its initial value (AttnRes queries, router
# biases) that the comparison depends on.
TINY_K3 = [
    "experiment=k3_tiny",
    "name=release_parity",
    "model.n_layers=5",
    "model.mtp_depth=1",
    "mixer=kda",
    "mixer.gate_lower_bound=-5.0",
    "mixer.full_rank_gate=true",
    "mixers.mla.rope=false",
    "mixers.mla.output_gate=true",
    "ffn=stable_latent_moe",
    "ffn.num_shared_experts=2",
    "ffn.activation=situ_glu",
    "ffns.dense.activation=situ_glu",
    "balancer=qb",
    "residual=block_attnres",
    "residual.block_size=2",
    "data=corpus",
    "data.seq_len=64",
    "data.batch_size=4",
    "data.val_tokens=1024",
    "trainer.max_steps=4",
    "trainer.val_check_interval=100",
    "trainer.enable_progress_bar=false",
    "trainer.compile=false",
    "trainer.max_time_minutes=null",
    "optimizer.warmup_steps=0",
    "logger=csv",
]
EXPORTS = {"fp32": [], "mxfp4": ["--mxfp4-experts"], "multimodal": ["--prefix", "multimodal"]}
# a byte-level prompt (data=corpus: ids are bytes) longer than one 64-token KDA chunk
PROMPT = b'def parse(line):\n    key, _, value = line.partition("=")\n    return key.strip(), value.strip()\n\n\nclass '
NEW_TOKENS = 8
# fp32 round-off through 5 layers, the release running fla's kernels under Triton's interpreter: about
# 7e-7 of the largest logit measured; a K3 detail computed wrongly moves them by 1e-2 or more
TOLERANCE = 1e-4
MTP_LAYER = 5  # the MTP depth's tensors: layers.5.* (layers 0-4 are the decoder's)


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def _run(*command: str, timeout: float = 900) -> subprocess.CompletedProcess:
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=_env(), timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(command)}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    """({export: (folder, what the release computed from it)}, the run folder, the prompt)."""
    work = tmp_path_factory.mktemp("release_parity")
    _run(sys.executable, "train.py", *TINY_K3, f"output_root={work / 'runs'}")
    (run,) = [p for p in (work / "runs").iterdir() if p.is_dir()]
    prompt = torch.tensor([list(PROMPT)])  # [1, T]
    torch.save(prompt, work / "prompt.pt")
    readers = {}  # each folder read while the next is exported (the interpreter's kernels are single-threaded)
    try:
        for name, flags in EXPORTS.items():
            _run(sys.executable, "-m", "analysis.export", *flags, str(run), str(work / name))
            command = [REFERENCE_PYTHON, str(READER), str(work / name), str(work / "prompt.pt"), str(NEW_TOKENS)]
            command.append(str(work / f"{name}.release.pt"))
            readers[name] = subprocess.Popen(
                command, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        read = {}
        for name, proc in readers.items():
            out, _ = proc.communicate(timeout=900)
            assert proc.returncode == 0, f"the release could not read the {name} export:\n{out[-4000:]}"
            read[name] = (work / name, torch.load(work / f"{name}.release.pt"))
    finally:
        for proc in readers.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return read, run, prompt


def _ours(parity, name):
    """The project's model the export came from: the run itself, or for MXFP4 the project's own
    dequantisation of the folder (the experts as the release sees them)."""
    from runtime.load_run import load_run

    read, run, _ = parity
    return load_run(str(read[name][0] if name == "mxfp4" else run))[1].float().eval()


def _max_relative(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """Largest difference relative to the largest logit (elementwise ratios blow up near zero)."""
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


@pytest.mark.parametrize("name", EXPORTS)
def test_the_release_reads_every_k3_decision_from_config_json(parity, name):
    _, release = parity[0][name]
    cfg = release["config"]
    expected_class = "KimiK3Config (text_config: KimiLinearConfig)" if name == "multimodal" else "KimiLinearConfig"
    assert release["config_class"] == expected_class
    # the flat folder names the project's class; the release's config class reads its fields all the same
    assert cfg["top_model_type"] == ("kimi_k3" if name == "multimodal" else "k3_sandbox")
    kda = cfg["linear_attn_config"]
    assert kda["gate_lower_bound"] == -5.0 and kda["use_full_rank_gate"] is True
    assert kda["kda_layers"] == [1, 2, 3] and kda["full_attn_layers"] == [4, 5]  # 3:1, final MLA (1-based)
    assert cfg["mla_use_nope"] is True and cfg["mla_use_output_gate"] is True and cfg["q_lora_rank"] == 32
    assert cfg["first_k_dense_replace"] == 1 and cfg["hidden_act"] == "situ"
    assert cfg["num_experts"] == 8 and cfg["num_shared_experts"] == 2
    assert cfg["latent_moe_use_norm"] is True and cfg["routed_expert_hidden_size"] == 32
    assert cfg["attn_res_block_size"] == 2 and cfg["num_hidden_layers"] == 5  # blocks [0,1] [2,3] [4]
    assert cfg["num_nextn_predict_layers"] == 1  # read, and ignored: the release has no MTP module


@pytest.mark.parametrize("name", EXPORTS)
def test_the_release_loads_every_tensor_under_its_own_name(parity, name):
    from safetensors.torch import load_file

    from components.hf import mxfp4

    folder, release = parity[0][name]
    prefix = "language_model." if name == "multimodal" else ""
    stored = load_file(str(folder / "model.safetensors"))
    mtp = sorted(k for k in stored if k.startswith(f"{prefix}model.layers.{MTP_LAYER}."))
    assert mtp and release["unloaded"] == mtp  # the MTP depth and nothing else is left out
    expected = {}  # the folder's tensors as the release should hold them after loading
    for key, t in stored.items():
        if key in mtp:
            continue
        if key.endswith(".weight_packed"):  # decompressed by compressed-tensors
            module = key[: -len(".weight_packed")]
            expected[f"{module}.weight"] = mxfp4.dequantize(t, stored[f"{module}.weight_scale"])
            expected[f"{module}.weight_scale"] = torch.exp2(stored[f"{module}.weight_scale"].float() - 127)
        elif not key.endswith(".weight_scale"):
            expected[key] = t.float()
    loaded = release["loaded"]
    assert sorted(loaded) == sorted(expected)  # same names: none renamed, none missing, none extra
    differ = [k for k in expected if not torch.equal(loaded[k], expected[k])]
    assert not differ, f"the release holds other values than the folder for {differ[:5]}"
    if name == "mxfp4":
        assert any(k.endswith(".weight_packed") for k in stored) and release["expert_dtypes"] == ["torch.bfloat16"]
    # the values the comparison depends on are off their initial zeros (AttnRes queries, router biases)
    assert all(loaded[k].abs().max() > 0 for k in loaded if k.endswith(("mlp_res_proj.weight", "correction_bias")))


@pytest.mark.parametrize("name", EXPORTS)
def test_logits_match_the_released_code(parity, name):
    _, release = parity[0][name]
    prompt = parity[2]
    with torch.no_grad():
        ours = _ours(parity, name)(prompt)  # [1, T, V]
    diff = _max_relative(ours, release["logits"])
    print(f"{name}: logits max relative difference {diff:.2e} (largest logit {release['logits'].abs().max():.3f})")
    assert diff < TOLERANCE, f"{name}: the project's logits differ from the release's by {diff:.3e} (relative)"


@pytest.mark.parametrize("name", EXPORTS)
def test_the_releases_cached_generate_matches(parity, name):
    _, release = parity[0][name]
    prompt = parity[2]
    T = prompt.shape[1]
    # the release's own cache: one prefill, then one position per step
    assert release["cache"] == "KimiDynamicCache" and release["step_lengths"] == [T] + [1] * (NEW_TOKENS - 1)
    sequence = release["sequences"]  # [1, T + NEW_TOKENS]
    assert torch.equal(sequence[:, :T], prompt) and sequence.shape[1] == T + NEW_TOKENS
    with torch.no_grad():  # the project's uncached forward over the same tokens
        ours = _ours(parity, name)(sequence[:, :-1])[0, T - 1 :]  # [NEW_TOKENS, V]
    theirs = release["step_logits"]
    diff = _max_relative(ours, theirs)
    print(f"{name}: generate() step logits max relative difference {diff:.2e}, tokens {sequence[0, T:].tolist()}")
    assert diff < TOLERANCE, f"{name}: generate()'s step logits differ from the project's by {diff:.3e} (relative)"
    # each token is the project's greedy choice too (a tie within round-off may go either way)
    chosen = ours.gather(1, sequence[0, T:, None])[:, 0]
    slack = TOLERANCE * theirs.abs().max()
    assert bool((chosen >= ours.max(dim=1).values - slack).all()), "generate() chose a token the project would not"
