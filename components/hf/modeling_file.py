"""The ``auto_map`` of an export whose model only the project computes, and the file it names.

``modeling_k3_sandbox.py`` in the folder imports the registered classes from the installed project
(``components/hf/transformers_model.py``), so ``trust_remote_code=True`` loads the folder with the
project's own decoder and nothing is copied into the folder but this import. Needs no transformers.
"""

from __future__ import annotations

import os

SANDBOX_MODEL_TYPE = "k3_sandbox"
KIMI_K3_MODEL_TYPE = "kimi_k3"
MODELING_FILE = "modeling_k3_sandbox.py"
_MODULE = MODELING_FILE[: -len(".py")]
AUTO_MAP = {
    SANDBOX_MODEL_TYPE: {
        "AutoConfig": f"{_MODULE}.K3SandboxConfig",
        "AutoModelForCausalLM": f"{_MODULE}.K3SandboxForCausalLM",
    },
    KIMI_K3_MODEL_TYPE: {
        "AutoConfig": f"{_MODULE}.KimiK3SandboxConfig",
        "AutoModelForCausalLM": f"{_MODULE}.KimiK3SandboxForConditionalGeneration",
    },
}
MODELING_SOURCE = '''"""This folder's model as the k3-sandbox project computes it: its own decoder, installed with
pip install 'k3-sandbox[hf]' (transformers reaches these classes through config.json's auto_map with
trust_remote_code=True; importing components.hf.transformers_model registers them without it)."""

from components.hf.transformers_model import (  # noqa: F401
    K3SandboxConfig,
    K3SandboxForCausalLM,
    KimiK3SandboxConfig,
    KimiK3SandboxForConditionalGeneration,
)
'''


def write_modeling_file(folder: str) -> str:
    """Write ``modeling_k3_sandbox.py`` into ``folder``; returns its name."""
    with open(os.path.join(folder, MODELING_FILE), "w") as f:
        f.write(MODELING_SOURCE)
    return MODELING_FILE
