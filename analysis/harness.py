"""Any run as an lm-evaluation-harness model, registered in the harness's registry as ``k3``.

    python -m analysis.harness --model k3 --model_args run=RUN[,device=cpu,max_length=N,batch_size=8] \
        --tasks TASKS [harness options]
    python -m analysis.evaluate RUN --tasks TASKS [--include-path DIR] [--limit N]

The first form is the harness's own command line (``lm_eval``) with this module imported first, so that
``--model k3`` resolves: the harness (0.4) discovers models only among its own modules, so a bare
``lm_eval --model k3`` cannot see a model defined outside it. The harness's own Hugging Face model runs
an exported folder the same way (``--model hf --model_args pretrained=OUT``): the command registers the
project's transformers classes first, and a plain ``lm_eval`` reaches them with ``trust_remote_code=True``.
Programmatically, ``import analysis.harness`` then ``lm_eval.simple_evaluate(model="k3", model_args="run=RUN",
...)``.

RUN is anything ``runtime/load_run.py`` loads; the tokenizer is the run's (bytes or its ``tokenizer.json``,
``load_tokenizer``). ``max_length`` (default: the run's training length) bounds the tokens one forward
pass sees: longer contexts keep their end. Needs the ``eval`` extra (``pip install -e '.[eval]'``).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Optional

import lm_eval.models  # noqa: F401  (the harness's own models, hf among them: its registry lists them only while empty)
import torch
from lm_eval.__main__ import cli_evaluate
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import simple_parse_args_string

from analysis.loglikelihood import continuation_logprobs, rolling_logprob
from components.sampling import generate
from runtime.cpu_thread_tuning import cpu_thread_tuner, thread_invariant
from runtime.load_run import RunLoadError, load_run, load_tokenizer

MODEL_NAME = "k3"


@register_model(MODEL_NAME)
class K3HarnessModel(TemplateLM):
    """A run's decoder and tokenizer behind the harness's three request types."""

    def __init__(
        self,
        run: str,
        device: str = "cpu",
        batch_size: int | str = 8,
        max_length: Optional[int] = None,
        max_batch_size: Optional[int] = None,
        **_: Any,
    ) -> None:
        super().__init__()
        max_length, batch_size = checked_sizes(max_length, batch_size)
        if str(device).startswith("cuda") and not torch.cuda.is_available():
            print(
                f"analysis.harness: device {device} is not available here; using the CPU", file=sys.stderr
            )  # the harness's CLI default is cuda
            device = "cpu"
        self.root, self.model = load_run(run, device=device)
        # the harness's requests keep their share of the cores on a busy machine (runtime/cpu_thread_tuning.py)
        self._thread_tuner = cpu_thread_tuner(device, invariant=thread_invariant(self.root))
        self.tokenizer_ = load_tokenizer(run, self.root)
        self.run = run
        self._device = torch.device(device)
        self.batch_size = (
            int(batch_size) if str(batch_size).isdigit() else 8
        )  # "auto" probing is not needed on small models
        self.max_length = int(max_length) if max_length else self.root.data.seq_len

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: Optional[dict] = None) -> "K3HarnessModel":
        """``--model_args`` with the harness's own ``--device`` / ``--batch_size`` filling only what they
        leave out (the harness passes both always, so ``run=R,device=cpu`` would otherwise clash)."""
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: Optional[dict] = None) -> "K3HarnessModel":
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        return cls(**arg_dict, **extra)

    # -- what TemplateLM needs -----------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer_.eod_id

    @property
    def tokenizer_name(self) -> str:
        return f"k3:{self.tokenizer_.describe()['hash']}"

    @property
    def device(self) -> torch.device:
        return self._device

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs: Any) -> list[int]:
        return [int(t) for t in self.tokenizer_.encode_batch([string])[0]]

    def _loglikelihood_tokens(
        self, requests: list[tuple[tuple[str, str], list[int], list[int]]], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        pairs = [(context, continuation) for _, context, continuation in requests]
        results = continuation_logprobs(
            self.model, pairs, self.max_length, self.batch_size, self._device, self._thread_tuner
        )
        for (key, _, _), result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", key, result)
        return results

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        out = []
        for request in requests:
            (text,) = request.args
            score = rolling_logprob(self.model, self.tok_encode(text), self.eot_token_id, self.max_length, self._device)
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), score)
            out.append(score)
        return out

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        out = []
        for request in requests:
            context, gen_kwargs = request.args
            text = self.complete(context, dict(gen_kwargs or {}))
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            out.append(text)
        return out

    # -- generation ----------------------------------------------------------------------------------
    def complete(self, context: str, gen_kwargs: dict[str, Any]) -> str:
        """Greedy (or sampled, with ``temperature`` > 0) continuation of ``context`` up to the first stop
        string in ``until`` (default: the end-of-document text) or ``max_gen_toks`` tokens."""
        until = gen_kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        max_new = int(gen_kwargs.pop("max_gen_toks", 256))
        temperature = float(gen_kwargs.pop("temperature", 0.0) or 0.0)
        do_sample = bool(gen_kwargs.pop("do_sample", temperature > 0))
        ids = self.tok_encode(context) or [self.eot_token_id]
        ids = ids[-max(1, self.max_length - max_new) :]  # room for the continuation within max_length
        generated: list[int] = []

        def on_token(token: torch.Tensor) -> bool:
            generated.append(int(token[0, 0]))
            text = self.tokenizer_.decode(generated)
            return generated[-1] == self.eot_token_id or any(stop in text for stop in until)

        generate(
            self.model,
            torch.tensor([ids], device=self._device),
            max_new,
            temperature=temperature if do_sample else 0.0,
            generator=torch.Generator(device=self._device).manual_seed(0),
            on_token=on_token,
        )
        if generated and generated[-1] == self.eot_token_id:
            generated = generated[:-1]
        text = self.tokenizer_.decode(generated)
        for stop in until:  # the harness expects the text before the first stop string
            text = text.split(stop)[0]
        return text


class HarnessArgumentError(ValueError):
    """A harness option or ``--model_args`` entry that cannot be used; the message names it."""


def _positive_int_arg(name: str, value: Any) -> Optional[int]:
    if value is None or value == "":
        return None
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise HarnessArgumentError(f"--model_args {name}={value}: not a whole number") from None
    if number < 1:
        raise HarnessArgumentError(f"--model_args {name}={value}: must be >= 1")
    return number


def checked_sizes(max_length: Any, batch_size: Any) -> tuple[Optional[int], Any]:
    """``--model_args`` max_length and batch_size as numbers (batch_size may be the harness's "auto...");
    HarnessArgumentError naming the first that is not a whole number >= 1."""
    max_length = _positive_int_arg("max_length", max_length)
    if not str(batch_size).startswith("auto"):
        batch_size = _positive_int_arg("batch_size", batch_size)
    return max_length, batch_size


def task_manager(tasks: list[str], include_path: Optional[str] = None):
    """The harness's TaskManager holding every task of ``tasks``; HarnessArgumentError naming those it
    does not know (before any model is loaded)."""
    from lm_eval.tasks import TaskManager  # start-up time: datasets and the task index, only when tasks run

    if include_path is not None and not os.path.isdir(include_path):
        raise HarnessArgumentError(f"--include-path {include_path}: no such folder")
    # the harness indexes its hundreds of built-in task files in about ten seconds: skipped when the
    # include path holds every task asked for
    manager = TaskManager(include_path=include_path, include_defaults=False) if include_path else None
    if manager is None or any(t not in manager.all_tasks for t in tasks):
        manager = TaskManager(include_path=include_path)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise HarnessArgumentError(
            f"--tasks: unknown task(s) {', '.join(unknown)} (harness tasks, or task YAML files in --include-path)"
        )
    return manager


def _register_transformers_classes() -> None:
    """The project's transformers classes registered, so the harness's own ``--model hf`` opens every
    export (``components/hf/transformers_model.py``); nothing without transformers installed."""
    try:
        import components.hf.transformers_model  # optional: the hf extra (transformers)  # noqa: F401
    except ImportError:
        pass


def main(argv: Optional[list[str]] = None) -> int:
    """The harness's own command line, with ``k3`` registered; the k3 model's sizes and the tasks are
    checked first (in that order), before the harness starts and the run loads."""
    argv = sys.argv[1:] if argv is None else argv
    _register_transformers_classes()
    known = argparse.ArgumentParser(add_help=False)
    known.add_argument("--tasks", "-t")
    known.add_argument("--include_path")
    known.add_argument("--model")
    known.add_argument("--model_args")
    asked, _ = known.parse_known_args(argv)
    try:
        if asked.model == MODEL_NAME and asked.model_args:
            # before the harness indexes its built-in tasks (about ten seconds), not when it builds the model
            given = simple_parse_args_string(asked.model_args)
            checked_sizes(given.get("max_length"), given.get("batch_size", 8))
        if asked.tasks and asked.tasks not in ("list", "list_groups", "list_tags", "list_subtasks"):
            task_manager([t for t in asked.tasks.split(",") if t], asked.include_path)
        sys.argv = ["lm_eval", *argv]
        cli_evaluate()
    except (RunLoadError, HarnessArgumentError) as err:  # one line, not a traceback
        print(f"analysis.harness: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
