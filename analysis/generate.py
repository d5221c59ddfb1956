"""Generate text from a trained run, streamed through the decoder's cache.

    python -m analysis.generate RUN_OR_CHECKPOINT --prompt "def fibonacci(n):" [--max-new-tokens 200]
        [--temperature 0.8] [--top-k 50] [--top-p 0.95] [--seed 0] [--device cpu]

RUN is anything ``runtime/load_run.py`` loads: a run folder, a checkpoint, or a folder ``analysis.export``
wrote. The tokenizer is the run's: an exported folder's ``tokenizer.json``, bytes for ``data=corpus``,
the prepared folder's ``tokenizer.json`` for ``data=code`` / ``text`` / ``memmap`` (a prepared folder) /
``mixture``. Prints the prompt and the continuation as it is generated, then the prefill time and the
decoding speed in tokens per second. Exit status 2, with one message, for a bad option (checked before
anything loads), a run that cannot be loaded or data without a tokenizer.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from components.data.text.tokenizers import TextTokenizer
from components.sampling import generate
from runtime.cli import finite_float, int_at_least, reports_errors, torch_device, utf8_text
from runtime.load_run import RunLoadError, load_run, load_tokenizer


class _Stream:
    """Prints the decoded continuation as tokens arrive, holding back an incomplete UTF-8 character."""

    def __init__(self, tokenizer: TextTokenizer):
        self.tokenizer, self.ids, self.printed = tokenizer, [], 0

    def __call__(self, token: torch.Tensor) -> None:
        self.ids.append(int(token[0, 0]))
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return
        sys.stdout.write(text[self.printed :])
        sys.stdout.flush()
        self.printed = len(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m analysis.generate", description=__doc__.split("\n\n")[0])
    p.add_argument("run", help="a run folder, a checkpoint (file or sharded folder) or an exported folder")
    p.add_argument("--prompt", required=True, type=utf8_text)
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=200)
    p.add_argument("--temperature", type=finite_float(0.0), default=0.8, help="0: greedy")
    p.add_argument("--top-k", type=int_at_least(1), default=None)
    p.add_argument("--top-p", type=finite_float(0.0, 1.0, above=True), default=None, help="in (0, 1]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", type=torch_device, default="cpu")
    args = p.parse_args(argv)
    return _generate(args)


@reports_errors("analysis.generate", RunLoadError)
def _generate(args: argparse.Namespace) -> int:
    root, model = load_run(args.run, device=args.device)
    tokenizer = load_tokenizer(args.run, root)
    ids = tokenizer.encode_batch([args.prompt])[0].tolist() or [tokenizer.eod_id]
    prompt = torch.tensor([ids], dtype=torch.long, device=args.device)
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    stream = _Stream(tokenizer)
    sys.stdout.write(args.prompt)
    timings: dict[str, float] = {}
    start = time.perf_counter()

    def on_token(token: torch.Tensor) -> None:
        timings.setdefault("first", time.perf_counter())
        stream(token)

    out = generate(
        model,
        prompt,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        generator=generator,
        on_token=on_token,
    )
    end = time.perf_counter()
    new = out.shape[1] - prompt.shape[1]
    prefill = timings.get("first", end) - start
    decode_rate = (new - 1) / max(end - timings.get("first", end), 1e-9) if new > 1 else 0.0
    print(
        f"\n\n[{prompt.shape[1]} prompt tokens, prefill {prefill * 1000:.0f} ms; {new} new tokens at "
        f"{decode_rate:.1f} tokens/s "
        f"({root.mixer.name}, {model.num_params():,} parameters, {args.device})]"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
