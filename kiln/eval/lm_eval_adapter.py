"""Run EleutherAI lm-evaluation-harness tasks on a kiln run.

`KilnLM` is registered as lm_eval model "kiln" (`lm_eval --model kiln --model_args
run_dir=runs/NAME,step=200`), and `run_lm_eval` calls `lm_eval.simple_evaluate` with an instance.
Scoring follows lm_eval's HF model: the context and continuation are tokenized separately and
concatenated (an empty context is replaced by EOS so the first token has something to condition
on), left-truncated to the model's context, and the continuation's log-probabilities are summed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kiln.errors import KilnError

try:
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as e:  # the optional extra is missing
    raise KilnError("lm-eval tasks need the lm-eval package: pip install 'kiln-lm[eval]'") from e


@register_model("kiln")
class KilnLM(LM):
    GEN_CHUNK = 32  # tokens generated between stop-string checks
    def __init__(self, run_dir: str | Path | None = None, step: int | str | None = None, device: str = "cpu",
                 batch_size: int | str = 8, loaded: Any = None, **_ignored):
        """Either `run_dir` (and optionally `step`) or an already `loaded` run (`kiln.eval.load.LoadedRun`)."""
        super().__init__()
        if loaded is None:
            if run_dir is None:
                raise KilnError("the kiln lm_eval model needs model_args run_dir=PATH")
            from kiln.eval.load import load_run

            loaded = load_run(run_dir, None if step in (None, "", "None") else int(step), device=device)
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.max_length = int(self.model.cfg.max_seq_len)
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 8
        self._device = next(self.model.parameters()).device

    # -------------------------------------------------------------------------- scoring primitives

    @property
    def eot_token_id(self) -> int:
        return int(self.tokenizer.eos_id)

    @property
    def tokenizer_name(self) -> str:
        return f"kiln:{self.loaded.run_dir}"

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        # Move trailing spaces of the context onto the continuation, as lm_eval's HF model does.
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            continuation = context[-n_spaces:] + continuation
            context = context[:-n_spaces]
        context_ids = self.tokenizer.encode(context) if context else []
        return context_ids or [self.eot_token_id], self.tokenizer.encode(continuation)

    @torch.no_grad()
    def score_pairs(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """Sum of log p(continuation | context) and whether greedy decoding yields the continuation.

        Sequences are right-padded into batches (the model is causal, so padding after a sequence
        cannot change its logits); the longest go first so batches hold similar lengths.
        """
        results: list[tuple[float, bool] | None] = [None] * len(pairs)
        order = sorted(range(len(pairs)), key=lambda i: -(len(pairs[i][0]) + len(pairs[i][1])))
        for start in range(0, len(order), self.batch_size):
            batch = order[start:start + self.batch_size]
            inputs, spans = [], []
            for i in batch:
                context_ids, continuation_ids = pairs[i]
                full = (context_ids + continuation_ids)[-(self.max_length + 1):]
                n_scored = min(len(continuation_ids), len(full) - 1)
                inputs.append(full[:-1])
                spans.append((len(full) - 1 - n_scored, full[len(full) - n_scored:]))
            width = max(len(x) for x in inputs)
            tokens = torch.zeros(len(inputs), width, dtype=torch.long)
            for row, ids in enumerate(inputs):
                tokens[row, :len(ids)] = torch.tensor(ids)
            logprobs = F.log_softmax(self.model(tokens.to(self._device)).float(), dim=-1).cpu()
            for row, i in enumerate(batch):
                offset, targets = spans[row]
                window = logprobs[row, offset:offset + len(targets)]
                target = torch.tensor(targets, dtype=torch.long)
                total = float(window.gather(-1, target[:, None]).sum())
                greedy = bool((window.argmax(-1) == target).all())
                results[i] = (total, greedy)
        return results  # type: ignore[return-value]

    # -------------------------------------------------------------------------- the LM interface

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [self._encode_pair(*req.args) for req in requests]
        results = self.score_pairs(pairs)
        for req, result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", req.args, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Whole-document log-likelihood in disjoint windows of the model's context (lm_eval's scheme)."""
        out = []
        for req in requests:
            (text,) = req.args[:1]
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=self.tokenizer.encode(text), prefix_token=self.eot_token_id,
                max_seq_len=self.max_length, context_len=1)]
            total = sum(lp for lp, _ in self.score_pairs(windows)) if windows else 0.0
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            out.append(total)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from kiln.model.generate import generate

        out = []
        for req in requests:
            context, gen_kwargs = req.args[0], dict(req.args[1] or {})
            until = gen_kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(gen_kwargs.pop("max_gen_toks", gen_kwargs.pop("max_new_tokens", 256)))
            do_sample = bool(gen_kwargs.pop("do_sample", False))
            temperature = float(gen_kwargs.pop("temperature", 0.0)) if do_sample else 0.0
            top_k, top_p = int(gen_kwargs.pop("top_k", 0) or 0), float(gen_kwargs.pop("top_p", 1.0) or 1.0)
            prompt = self.tokenizer.encode(context) or [self.eot_token_id]
            new_ids: list[int] = []
            # Generate in chunks and stop once a stop string appears, instead of always running
            # to max_gen_toks; each chunk re-reads the (growing) prompt into a fresh KV cache.
            while len(new_ids) < max_new:
                want = min(self.GEN_CHUNK, max_new - len(new_ids))
                chunk = generate(self.model, prompt + new_ids, max_new_tokens=want, temperature=temperature,
                                 top_k=top_k, top_p=top_p, eos_id=self.eot_token_id)
                new_ids += chunk
                if len(chunk) < want or any(s and s in self.tokenizer.decode(new_ids) for s in until):
                    break  # EOS (or the context end), or a stop string
            text = self.tokenizer.decode(new_ids)
            for stop in until:
                if stop and stop in text:
                    text = text[:text.index(stop)]
            self.cache_hook.add_partial("generate_until", (context, req.args[1]), text)
            out.append(text)
        return out


def task_manager(tasks: list[str], include_path: list[str] | None = None, include_defaults: bool = True):
    """A TaskManager that knows `tasks`; indexes only the include paths when they hold every task.

    Indexing lm_eval's thousands of built-in task YAMLs takes tens of seconds, so a run over
    local tasks only skips it.
    """
    from lm_eval.tasks import TaskManager

    for path in include_path or []:
        if not Path(path).exists():
            raise KilnError(f"--lm-eval-include {path} not found (expected a directory or file of task YAMLs)")
    paths = [str(p) for p in include_path] if include_path else None
    manager = None
    if paths:
        manager = TaskManager(include_path=paths, include_defaults=False)
        if include_defaults and not all(manager.match_tasks([t]) for t in tasks):
            manager = None
    if manager is None:
        manager = TaskManager(include_path=paths, include_defaults=include_defaults)
    unknown = [t for t in tasks if not manager.match_tasks([t])]
    if unknown:
        raise KilnError(f"unknown lm-eval task(s) {unknown}; add --lm-eval-include DIR for local task YAMLs")
    return manager


def run_lm_eval(loaded, tasks: list[str], *, include_path: list[str] | None = None, limit: int | float | None = None,
                batch_size: int = 8, num_fewshot: int | None = None, include_defaults: bool = True) -> dict:
    """Evaluate `loaded` (a LoadedRun) on lm_eval `tasks`; returns {"results": ..., "versions": ..., ...}."""
    from lm_eval import simple_evaluate

    manager = task_manager(tasks, include_path, include_defaults)
    model = KilnLM(loaded=loaded, batch_size=batch_size)
    output = simple_evaluate(model=model, tasks=tasks, task_manager=manager, limit=limit, num_fewshot=num_fewshot,
                             log_samples=False, bootstrap_iters=0)
    if output is None:
        raise KilnError("lm-eval returned no results")
    return {"results": _plain(output.get("results", {})), "versions": _plain(output.get("versions", {})),
            "n_samples": _plain(output.get("n-samples", {})), "config": {"tasks": tasks, "limit": limit}}


def _plain(obj: Any) -> Any:
    """JSON-safe copy (lm_eval results may hold numpy scalars and 'N/A' strings)."""
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item):
        return obj.item()
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)
