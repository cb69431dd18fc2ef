"""Compute-optimal model and data size for a budget (C = 6*N*D), and the loss they predict.

Constants (all from the papers, not fitted here):
- Kaplan et al. 2020, "Scaling Laws for Neural Language Models", eq. 6.1 / fig. 14:
  N_opt = 1.3e9 * C_pfdays**0.73 (non-embedding parameters; 1 PF-day = 8.64e19 FLOP).
- Hoffmann et al. 2022, "Training Compute-Optimal Large Language Models" (Chinchilla), table 2:
  N_opt ~ C**a with a = 0.50 (approach 1), 0.49 (approach 2), 0.46 (approach 3); approach 3's
  parametric fit L(N, D) = E + A/N**alpha + B/D**beta with E=1.69, A=406.4, B=410.7, alpha=0.34,
  beta=0.28 (section 3.3). Approaches 1 and 2 publish exponents, not intercepts: their
  coefficient is anchored at table 3's first row (approach 1: 400M parameters for 1.92e19 FLOPs),
  which is how the paper itself projects them. Approach 3 is the closed-form minimiser of the
  parametric law under C = 6ND: N_opt = G*(C/6)**(beta/(alpha+beta)), G = (alpha*A/(beta*B))**(1/(alpha+beta)).

`fit_loss_law` fits the same parametric law to the user's own short runs the way the paper did
(Huber loss on log-loss residuals, L-BFGS from a grid of starts); the optimiser is torch's.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from pathlib import Path

from kiln.errors import KilnError

PFLOP_DAY = 1e15 * 86400
KAPLAN_N_COEF, KAPLAN_N_EXP = 1.3e9, 0.73
CHINCHILLA_EXPONENTS = {1: 0.50, 2: 0.49, 3: None}  # approach 3 follows from the parametric fit
CHINCHILLA_ANCHOR = (1.92e19, 400e6)  # table 3: 400M parameters are optimal at 1.92e19 FLOPs


@dataclass(frozen=True)
class LossLaw:
    """L(N, D) = E + A / N**alpha + B / D**beta."""
    E: float = 1.69
    A: float = 406.4
    B: float = 410.7
    alpha: float = 0.34
    beta: float = 0.28

    def loss(self, n_params: float, n_tokens: float) -> float:
        return self.E + self.A / n_params ** self.alpha + self.B / n_tokens ** self.beta

    def optimal_params(self, flops: float) -> float:
        """The N minimising loss at C = 6ND (closed form; Hoffmann et al. eq. 4)."""
        g = (self.alpha * self.A / (self.beta * self.B)) ** (1 / (self.alpha + self.beta))
        return g * (flops / 6) ** (self.beta / (self.alpha + self.beta))


CHINCHILLA = LossLaw()


@dataclass(frozen=True)
class Allocation:
    law: str
    params: float
    tokens: float
    loss: float | None  # the Chinchilla parametric prediction (or the user's fitted law)


def flops_from_gpu_hours(gpus: int, hours: float, peak_flops: float, mfu: float) -> float:
    """A budget given as GPUs x hours at a model-FLOPs utilisation, in FLOPs."""
    return gpus * hours * 3600 * peak_flops * mfu


def kaplan_params(flops: float) -> float:
    return KAPLAN_N_COEF * (flops / PFLOP_DAY) ** KAPLAN_N_EXP


def chinchilla_params(flops: float, approach: int, law: LossLaw = CHINCHILLA) -> float:
    if approach not in CHINCHILLA_EXPONENTS:
        raise KilnError(f"Chinchilla approach {approach}: expected 1, 2 or 3")
    a = CHINCHILLA_EXPONENTS[approach]
    if a is None:
        return law.optimal_params(flops)
    c0, n0 = CHINCHILLA_ANCHOR
    return n0 * (flops / c0) ** a


def tokens_for_params(n_params: float, approach: int = 3, law: LossLaw = CHINCHILLA) -> float:
    """The reverse: the compute-optimal token count for a model of `n_params` (solves N_opt(C) = N
    by bisection on log C, then D = C / 6N)."""
    if n_params <= 0:
        raise KilnError(f"parameter count {n_params} must be > 0")
    lo, hi = 0.0, 60.0  # log10 FLOPs
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chinchilla_params(10 ** mid, approach, law) < n_params else (lo, mid)
    return 10 ** lo / (6 * n_params)


def allocations(flops: float, law: LossLaw = CHINCHILLA) -> list[Allocation]:
    """Kaplan's and Chinchilla's three optimal (N, D) for `flops`, each with its predicted loss."""
    if not (math.isfinite(flops) and flops > 0):
        raise KilnError(f"compute budget {flops} FLOPs must be a positive number")
    rows = [("kaplan", kaplan_params(flops))]
    rows += [(f"chinchilla-{k}", chinchilla_params(flops, k, law)) for k in (1, 2, 3)]
    return [Allocation(name, n, flops / (6 * n), law.loss(n, flops / (6 * n))) for name, n in rows]


# ---------------------------------------------------------------------------- fit to the user's runs


def fit_loss_law(points: list[tuple[float, float, float]], delta: float = 1e-3) -> LossLaw:
    """Fit E, A, B, alpha, beta to (params, tokens, loss) triples as Hoffmann et al. did: minimise
    the Huber loss of log L_pred - log L over log-parameterised A, B, E, from a grid of starts."""
    import torch

    if len(points) < 3:
        raise KilnError(f"fitting a loss law needs at least 3 finished runs of different sizes; got {len(points)}")
    t = torch.tensor(points, dtype=torch.float64)
    log_n, log_d, log_l = t[:, 0].log(), t[:, 1].log(), t[:, 2].log()
    if not torch.isfinite(log_l).all() or (t <= 0).any():
        raise KilnError("every run must have positive, finite parameters, tokens and loss")
    def huber(x):
        pred = torch.logsumexp(torch.stack([x[0] - x[3] * log_n, x[1] - x[4] * log_d, x[2].expand_as(log_n)]), dim=0)
        return torch.nn.functional.huber_loss(pred, log_l, delta=delta, reduction="sum")

    best, best_obj = None, math.inf
    for a0, b0, e0, al0, be0 in itertools.product((6.0, 0.0), (6.0, 0.0), (0.5, -1.0), (0.3, 0.5), (0.3, 0.5)):
        x = torch.tensor([a0, b0, e0, al0, be0], dtype=torch.float64, requires_grad=True)
        opt = torch.optim.LBFGS([x], max_iter=100, tolerance_grad=1e-12, tolerance_change=1e-14,
                                line_search_fn="strong_wolfe")

        def closure():
            opt.zero_grad()
            obj = huber(x)
            obj.backward()
            return obj

        opt.step(closure)
        with torch.no_grad():
            obj = float(huber(x))
        if math.isfinite(obj) and obj < best_obj and float(x[3]) > 0 and float(x[4]) > 0:
            best, best_obj = x.detach().clone(), obj
        if best_obj < 1e-9:  # an exact fit: later starts cannot improve it
            break
    if best is None:
        raise KilnError("the loss law did not converge on these runs (losses must fall with size)")
    a, b, e, alpha, beta = best.tolist()
    return LossLaw(E=math.exp(e), A=math.exp(a), B=math.exp(b), alpha=alpha, beta=beta)


def sweep_points(sweep_dir: str | Path) -> list[tuple[float, float, float]]:
    """(params, tokens trained, best validation loss) for each completed trial of a `kiln sweep`
    directory, read from its sweep.json and each trial's config.toml."""
    import json

    from kiln.config import load_config
    from kiln.plan.memory import ModelShape, vocab_estimate

    sweep_dir = Path(sweep_dir)
    path = sweep_dir / "sweep.json"
    try:
        records = json.loads(path.read_text(encoding="utf-8"))["trials"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise KilnError(f"{path}: not a kiln sweep result ({e})") from None
    points = []
    for r in records if isinstance(records, list) else []:
        if not isinstance(r, dict) or r.get("status") != "completed":
            continue
        loss, steps, trial = r.get("best_val_loss"), r.get("steps_done"), str(r.get("trial", ""))
        if not isinstance(loss, (int, float)) or not isinstance(steps, int) or "/" in trial or trial.startswith("."):
            continue
        cfg = load_config(sweep_dir / trial / "config.toml")
        vocab, _ = vocab_estimate(cfg)
        tokens = steps * cfg.train.batch_size * cfg.train.grad_accum * cfg.data.seq_len
        points.append((float(ModelShape.from_config(cfg.model, vocab).params), float(tokens), float(loss)))
    return points
