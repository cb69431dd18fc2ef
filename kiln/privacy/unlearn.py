"""Knowledge unlearning by gradient ascent (Jang et al. 2022, "Knowledge Unlearning for
Mitigating Privacy Risks in Language Models").

The forget sequences are split into sequential chunks of `chunk` sequences (0: all at once). For
each chunk the model takes AdamW steps on the *negated* LM loss of the chunk (plus, optionally, a
retain term: the LM loss, or the KL divergence from the original model, on windows of retain
text) until the stop rule holds or `max_steps` is spent.

The stop rule is Jang et al.'s, applied to the forget set seen so far (chunks 1..c; the chunk
itself when c = 1 or chunk = 0): its extraction likelihood and memorization accuracy are no
higher than the held-out reference (measured before unlearning) + `margin`. The chunk's own
metrics are reported but not required: the ascent on one sequence lowers the others' (with
canaries, every canary's digit predictions, held-out ones included), so asking each small chunk
to reach the band on its own drove the seen set far under it (chunks of 1: MA 0.64 vs the band
[0.69, 0.79], benchmarks/README.md). The rule is checked before the chunk's first step (earlier
chunks may already have brought the seen set there) and after every step (`check_every` 1).
A step that overshoots - EL or MA of the seen set below the reference - `margin` - is cut back by
bisection (`bisect` halvings): the parameters are set to before + f * (after - before) for
f = 1/2, 1/4 or 3/4, ... (torch.lerp; with weight decay 0 this is the same AdamW update scaled by
f, so the moments stay those of the gradient taken) and the largest f found that does not
overshoot is kept. If none does (f < 2**-bisect), the step is undone and the chunk stops
("overshoot": the band cannot be entered from here without leaving it below); `bisect` 0 keeps
every whole step (the old behaviour). Exposure is measured and reported (per chunk and
before/after) but is not part of the stop rule: one canary's exposure is
too noisy a target (with chunks of 1 it drove EL to 0). It does count when deciding whether the
forget set looks memorized at all (`exposure_margin`). With `stop_on_exposure` the rule also asks
that the mean exposure of the forget set seen so far be no higher than the held-out canaries' +
`exposure_margin` (checked only once EL and MA pass, since exposure ranks every candidate): EL and
MA count argmax hits, and a secret that is no longer the argmax can still rank near the top of the
candidates, which is what an attacker who guesses by likelihood exploits. Steps are not cut back
under `stop_on_exposure`: reaching the held-out exposure takes EL and MA under the band (the
benchmark's chunks of 4: MA 0.54 vs 0.74), and the stricter target is what was asked for.

With `secret_only` (default) the ascent on a canary row is masked to its secret's digits: the
loss counts only those tokens, not the prefix ("my code is ") or the '-' separators that every
canary - and the held-out ones - share, so the format is not unlearned with the secret. Rows
without a secret (plain text) ascend on every token. The tokens of such a row that are not ascended on - the
format - get an LM (descent) term, weighted by `format_weight` (default 1; 0: off): without it the
ascent on the digits also lowered the separators' predictions of every canary (a never-ascended
canary of the forget set fell to MA 0.67, under the band, on the benchmark model), which no stop
rule can undo since ascent only lowers. With the format kept, a canary whose digits are all
missed still predicts its format (15 of 21 targets for 6 digits: MA 0.71), near the reference.
Metrics come from kiln.privacy.metrics; the optimizer, KL and interpolation are torch's (AdamW,
F.kl_div, torch.lerp); the masking and the bisection are hand-written (boolean masks on the
per-token NLL; a loop of halvings).

Nothing here assumes one device: tensors go to the device of the model's parameters, and under
data parallelism (FSDP, DDP; `Shard`) each rank ascends on its block of every chunk and retain
batch and the metrics are measured sharded and gathered (kiln/commands/unlearn.py builds the
mesh and loads the model; tests/privacy/test_unlearn_parallel.py checks 2 ranks == 1 process).
"""

from __future__ import annotations

import copy
import math
import random
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from kiln.privacy.metrics import Shard, reshard, sequence_metrics, summarize, token_nll


@dataclass
class UnlearnOptions:
    chunk: int = 0  # sequences per sequential chunk; 0: all at once
    lr: float = 1e-4
    max_steps: int = 200  # step budget per chunk
    check_every: int = 1  # check the stop rule every this many steps (1: stop at the first step that meets it)
    bisect: int = 5  # halvings to cut back a step that overshoots the band (0: keep whole steps)
    secret_only: bool = True  # canary rows: ascend only on the secret's tokens, not the shared prefix
    format_weight: float = 1.0  # and (secret_only) descend on the other tokens - the format - with this weight
    margin: float = 0.05  # stop when EL and MA <= held-out reference + margin
    exposure_margin: float = 1.0  # canaries: and exposure <= held-out reference + this (bits)
    stop_on_exposure: bool = False  # also stop only when the seen forget set's exposure is at the reference
    retain_loss: str = "lm"  # lm | kl (used only with retain windows)
    retain_weight: float = 1.0
    retain_batch: int = 8
    clip_grad_norm: float = 1.0
    force: bool = False  # unlearn even when the forget set does not look memorized
    ngram: int = 5
    el_stride: int = 1
    candidates: int = 1000
    seed: int = 0


def _memorized(summary: dict, reference: dict, opts: "UnlearnOptions") -> bool:
    """Does the forget set look memorized? Above the held-out reference on EL or MA (or, for
    canaries, exposure), beyond the margins."""
    if "exposure" in summary and "exposure" in reference \
            and summary["exposure"] > reference["exposure"] + opts.exposure_margin:
        return True
    return not _at_reference(summary, reference, opts)


def _at_reference(summary: dict, reference: dict, opts: "UnlearnOptions") -> bool:
    """The stop rule (Jang et al. 2022): EL and MA no higher than the held-out reference + margin."""
    return summary["el"] <= reference["el"] + opts.margin and summary["ma"] <= reference["ma"] + opts.margin


def _overshot(summary: dict, reference: dict, opts: "UnlearnOptions") -> bool:
    """EL or MA below the band: lower than the held-out reference - margin."""
    return summary["el"] < reference["el"] - opts.margin or summary["ma"] < reference["ma"] - opts.margin


def ascent_mask(tokenizer, rows: list[dict], seqs: list[list[int]], secret_only: bool) -> list[list[bool]]:
    """Per target position (token 1..n-1 of each sequence): ascend on it? With `secret_only`, a
    canary row ascends only on the tokens that start a digit of its secret: the prefix and the
    '-' separators are the format every canary (and every held-out one) shares. A digit's token
    is located by encoding text up to it, so this holds for any tokenizer whose encodings of
    those prefixes are prefixes of the text's tokens (the byte tokenizer); otherwise the row
    ascends on every token."""
    out = []
    for row, ids in zip(rows, seqs):
        keep = [True] * (len(ids) - 1)
        if secret_only and row.get("secret") is not None and row.get("prefix") is not None:
            starts = []
            for i, ch in enumerate(row["secret"]):
                if ch.isdigit():
                    head = tokenizer.encode(row["prefix"] + row["secret"][:i])
                    if not 0 < len(head) < len(ids) or ids[:len(head)] != head:
                        starts = []
                        break
                    starts.append(len(head))
            if starts:
                keep = [False] * (len(ids) - 1)
                for t in starts:
                    keep[t - 1] = True  # target j is token j + 1
        out.append(keep)
    return out


def _retain_term(model: torch.nn.Module, windows: list[list[int]], weights: torch.Tensor, total_rows: int,
                 original: torch.nn.Module | None) -> torch.Tensor:
    """This rank's part of the retain term: the sum over its windows' positions (rows weighted 0
    are padding), divided by the positions of the whole batch, so the parts add up to the mean
    over the global batch (the LM loss, or KL(original || model) per position)."""
    device = weights.device
    inputs = torch.tensor([w[:-1] for w in windows], device=device)
    targets = torch.tensor([w[1:] for w in windows], device=device)
    logits = model(inputs).float()
    if original is None:
        per_pos = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    else:
        with torch.no_grad():
            ref_logp = original(inputs).float().log_softmax(-1)
        per_pos = F.kl_div(logits.log_softmax(-1), ref_logp, log_target=True, reduction="none").sum(-1)
    return (per_pos * weights[:, None]).sum() / (total_rows * inputs.shape[1])


@torch.no_grad()
def _cut_back(params: list[torch.Tensor], before: list[torch.Tensor], check: Callable[[], tuple[bool, dict]],
              reference: dict, opts: UnlearnOptions) -> tuple[float, bool, dict]:
    """Bisect the step just taken (parameters `before` -> now) for the largest fraction f in
    (0, 1) whose parameters before + f * (now - before) do not overshoot the band; leaves the
    parameters there (f = 0: back to `before`) and returns (f, check() there). The metrics are
    argmax counts, not monotone in f in general: bisection finds a fraction at a boundary, not
    necessarily the largest one."""
    after = [p.detach().clone() for p in params]
    lo, hi, at_lo = 0.0, 1.0, None
    for _ in range(opts.bisect):
        mid = (lo + hi) / 2
        for p, b, a in zip(params, before, after):
            p.copy_(torch.lerp(b, a, mid))
        result = check()
        if _overshot(result[1], reference, opts):
            hi = mid
        else:
            lo, at_lo = mid, result
    for p, b, a in zip(params, before, after):
        p.copy_(torch.lerp(b, a, lo) if lo else b)
    return lo, *(at_lo if at_lo is not None else check())


def _grad_norm(norm: torch.Tensor) -> float:
    full = getattr(norm, "full_tensor", None)  # a DTensor under FSDP
    return float(full() if full is not None else norm)


def unlearn(model: torch.nn.Module, tokenizer, forget: list[dict], heldout: list[dict],
            retain_windows: list[list[int]], opts: UnlearnOptions, *, shard: Shard = Shard(),
            original: torch.nn.Module | None = None, log: Callable[[str], None] = print) -> dict:
    """Unlearn `forget` rows in place on `model`; returns the report (metrics before/after, per
    chunk and per step). With a forget set that is not memorized (and not `force`) the model is
    left untouched and the report's status is "not_memorized".

    Data parallel (`shard`): every rank passes the same rows, windows and options; each ascends on
    its block of the chunk and of the retain batch, scaled so that the gradient averaged over the
    ranks (FSDP/DDP) is the single-process gradient; metrics are measured sharded and gathered
    (kiln.privacy.metrics.Shard), so every rank returns the same report. `original`: the frozen
    model of the KL retain term (default: a copy of `model`, one process only)."""
    # Under FSDP a forward (the caller's validation pass) can leave gathered parameters registered
    # on the last block, which an optimizer built then would step instead of the shards.
    reshard(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=opts.lr, weight_decay=0.0)
    metric_kw = dict(ngram=opts.ngram, stride=opts.el_stride, candidates=opts.candidates, seed=opts.seed,
                     shard=shard)

    def measure(rows: list[dict], with_exposure: bool = False) -> dict:
        return summarize(sequence_metrics(model, tokenizer, rows, with_exposure=with_exposure, **metric_kw))

    reference = summarize(sequence_metrics(model, tokenizer, heldout, **metric_kw))
    before_items = sequence_metrics(model, tokenizer, forget, **metric_kw)
    before = summarize(before_items)
    report = {"options": asdict(opts), "heldout_reference": reference, "forget_before": before, "chunks": []}
    log(f"forget set: EL {before['el']:.3f} MA {before['ma']:.3f}; held-out reference: "
        f"EL {reference['el']:.3f} MA {reference['ma']:.3f}")
    if not _memorized(before, reference, opts) and not opts.force:
        report["status"] = "not_memorized"
        return report

    device = next(model.parameters()).device
    if retain_windows and opts.retain_loss == "kl" and original is None:
        if shard.size > 1:
            raise ValueError("--retain-loss kl under data parallelism needs the original model passed in")
        original = copy.deepcopy(model)
    if original is not None:
        original.eval().requires_grad_(False)
    kl_model = original if retain_windows and opts.retain_loss == "kl" else None
    rng = random.Random(opts.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    size = opts.chunk or len(forget)
    total_steps, t0 = 0, time.perf_counter()
    for start in range(0, len(forget), size):
        rows, seen = forget[start:start + size], forget[:start + size]
        seqs = [tokenizer.encode(r["text"]) for r in rows]
        keep = ascent_mask(tokenizer, rows, seqs, opts.secret_only)
        # The format of canary rows whose ascent is masked to the secret: every target not ascended on.
        fmt = [[not a for a in k] if not all(k) else [False] * len(k) for k in keep]
        n_targets = sum(map(sum, keep))  # over the whole chunk: every rank knows all rows
        n_format = sum(map(sum, fmt)) if opts.format_weight > 0 else 0
        mine, real = shard.block(list(range(len(rows))))
        width = max(len(seqs[i]) for i in mine) - 1

        def my_mask(per_row: list[list[bool]]) -> torch.Tensor:  # this rank's rows, padding rows all False
            return torch.tensor([(per_row[i] if k < real else [False] * len(per_row[i]))
                                 + [False] * (width - len(per_row[i])) for k, i in enumerate(mine)], device=device)

        mask, format_mask = my_mask(keep), my_mask(fmt)
        my_seqs = [seqs[i] for i in mine]

        def check() -> tuple[bool, dict]:
            """The stop rule on the forget set seen so far (and its exposure with stop_on_exposure)."""
            so_far = measure(seen)
            if not _at_reference(so_far, reference, opts):
                return False, so_far
            if opts.stop_on_exposure and "exposure" in reference:
                exposed = measure(seen, with_exposure=True)
                if exposed.get("exposure", -math.inf) > reference["exposure"] + opts.exposure_margin:
                    return False, so_far
            return True, so_far

        # Checked now, not only after a step: earlier chunks' steps may already have brought the
        # seen set to the reference, and a step beyond it only overshoots.
        done, so_far = check()
        steps, history, stopped = 0, [], "reference" if done else "step_budget"
        while not done and steps < opts.max_steps:
            model.train()
            reshard(model)  # the parameters the optimizer steps (FSDP: the shards)
            # (With stop_on_exposure the exposure target wins: EL/MA may go under the band to reach it.)
            cut_back = opts.bisect > 0 and not opts.stop_on_exposure
            start_params = [p.detach().clone() for p in params] if cut_back else None
            nll, _ = token_nll(model, my_seqs)
            forget_part = -(nll * mask).sum() / n_targets  # gradient ascent on the chunk's (secret) tokens
            loss = forget_part
            format_part = None
            if n_format:  # descent on the canaries' shared format, so the ascent does not unlearn it
                format_part = (nll * format_mask).sum() / n_format
                loss = loss + opts.format_weight * format_part
            retain_part = None
            if retain_windows:
                batch = [retain_windows[rng.randrange(len(retain_windows))] for _ in range(opts.retain_batch)]
                my_windows, real_w = shard.block(batch)
                weights = torch.tensor([1.0 if k < real_w else 0.0 for k in range(len(my_windows))], device=device)
                retain_part = _retain_term(model, my_windows, weights, len(batch), kl_model)
                loss = loss + opts.retain_weight * retain_part
            optimizer.zero_grad(set_to_none=True)
            # FSDP/DDP average gradients over ranks; the parts are sums over the global batch.
            (loss * shard.size).backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                  opts.clip_grad_norm if opts.clip_grad_norm > 0 else math.inf)
            optimizer.step()
            steps += 1
            row = {"step": steps, "loss": float(shard.sum(loss.detach())), "forget_nll": -float(shard.sum(
                forget_part.detach())), "grad_norm": _grad_norm(norm)}
            if format_part is not None:
                row["format_nll"] = float(shard.sum(format_part.detach()))
            if retain_part is not None:
                row["retain"] = float(shard.sum(retain_part.detach()))
            if steps % opts.check_every == 0 or steps == opts.max_steps:
                done, so_far = check()
                if start_params is not None and _overshot(so_far, reference, opts):
                    fraction, done, so_far = _cut_back(params, start_params, check, reference, opts)
                    row["fraction"] = fraction
                    if fraction == 0.0:
                        stopped = "overshoot"
                row.update(el=so_far["el"], ma=so_far["ma"])
                if done:
                    stopped = "reference"
            history.append(row)
            if stopped == "overshoot":
                break
        total_steps += steps
        end = measure(rows, with_exposure=True)
        report["chunks"].append({
            "first": start, "size": len(rows), "steps": steps, "reached_reference": done, "stopped": stopped,
            **{k: end[k] for k in ("el", "ma", "exposure") if k in end},
            "seen_el": so_far["el"], "seen_ma": so_far["ma"], "history": history})
        log(f"chunk {start // size + 1}: {len(rows)} sequences, {steps} steps, EL {end['el']:.3f} "
            f"MA {end['ma']:.3f}, seen so far EL {so_far['el']:.3f} MA {so_far['ma']:.3f}"
            f"{'' if done else f' (stopped: {stopped})'}")
    model.eval()
    report["forget_after"] = summarize(sequence_metrics(model, tokenizer, forget, **metric_kw))
    report["heldout_after"] = summarize(sequence_metrics(model, tokenizer, heldout, **metric_kw))
    report["steps"] = total_steps
    report["seconds"] = time.perf_counter() - t0
    stops = {c["stopped"] for c in report["chunks"]}
    report["status"] = "done" if stops == {"reference"} else "overshoot" if "overshoot" in stops else "step_budget"
    return report
