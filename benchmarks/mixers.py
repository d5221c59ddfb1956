"""Sequence mixers side by side, measured in one run.

    PYTHONPATH=. python benchmarks/mixers.py [--quick] [--skip-ops]

1. KDA core forward+backward: chunked vs token-by-token recurrence vs causal SDPA at
   T = 512, 1024, 2048, 4096 (B=1, H=4, K=V=64), interleaved, as ratios (benchmarks/kda_ops.py).
2. Decoding with the cache, for every registered mixer in the same small model (d_model 256,
   4 layers, fp32, B=1): milliseconds per generated token after a 512-token prefill (interleaved),
   cache bytes per token per layer (what grows with the sequence) and fixed state bytes per layer.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import kda_ops  # noqa: E402
from timing import medians, time_interleaved  # noqa: E402

from components.model import Decoder  # noqa: E402
from components.registry import MIXERS  # noqa: E402
from runtime.compose import compose, strip_hydra  # noqa: E402
from runtime.validation import validate  # noqa: E402

PREFILL, DECODE = 512, 32


def build(mixer: str) -> Decoder:
    torch.manual_seed(0)
    root = validate(strip_hydra(compose(["model=small", "model.n_layers=4", f"mixer={mixer}", "mixer.n_heads=4"])))
    return Decoder(root).eval()


def decode_step(model: Decoder, prompt: torch.Tensor):
    """A callable that decodes DECODE tokens after a fresh prefill; the prefill is outside the timing."""
    state = {}

    def prepare():
        state["cache"] = model.new_cache()
        with torch.no_grad():
            model(prompt, cache=state["cache"])

    def run():
        with torch.no_grad():
            token = prompt[:, -1:]
            for _ in range(DECODE):
                token = model(token, cache=state["cache"])[:, -1:].argmax(-1)
        prepare()

    prepare()
    return run


def cache_bytes(model: Decoder, prompt: torch.Tensor) -> tuple[float, float]:
    """(bytes per token per layer that grow with the sequence, fixed bytes per layer)."""
    sizes = []
    for T in (PREFILL // 2, PREFILL):
        cache = model.new_cache()
        with torch.no_grad():
            model(prompt[:, :T], cache=cache)
        sizes.append(cache.nbytes())
    n_layers = len(model.layers)
    per_token = (sizes[1] - sizes[0]) / (PREFILL - PREFILL // 2) / n_layers
    fixed = sizes[1] / n_layers - per_token * PREFILL
    return per_token, fixed


def decode_table(repeats: int) -> None:
    models = {name: build(name) for name in MIXERS.names()}
    prompt = torch.randint(0, 257, (1, PREFILL))
    fns = {name: decode_step(m, prompt) for name, m in models.items()}
    times = medians(time_interleaved(fns, repeats))
    print(
        f"\nDecoding, d_model 256, 4 layers, fp32, B=1, after a {PREFILL}-token prefill, CPU "
        f"threads={torch.get_num_threads()}"
    )
    base = times.get("mha")
    print(f"{'mixer':>6} {'ms/token':>9} {'vs mha':>7} {'cache B/token/layer':>20} {'state B/layer':>14}")
    for name, m in models.items():
        per_token, fixed = cache_bytes(m, prompt)
        ms = 1e3 * times[name] / DECODE
        rel = times[name] / base if base else float("nan")
        print(f"{name:>6} {ms:>9.2f} {rel:>6.2f}x {per_token:>20.0f} {fixed:>14.0f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--skip-ops", action="store_true", help="only the decoding table")
    args = p.parse_args()
    if not args.skip_ops:
        sys.argv = [sys.argv[0]] + (["--quick"] if args.quick else [])
        kda_ops.main()
    decode_table(repeats=3 if args.quick else 7)


if __name__ == "__main__":
    main()
