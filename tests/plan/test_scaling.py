import math

import pytest

from kiln.errors import KilnError
from kiln.plan import scaling


def test_chinchilla_approach_1_matches_its_table_3():
    # Hoffmann et al. table 3: 67B parameters and 1.5T tokens at 5.76e23 FLOPs; 10B at 1.23e22
    n = scaling.chinchilla_params(5.76e23, 1)
    assert 60e9 < n < 75e9
    assert 1.2e12 < 5.76e23 / (6 * n) < 1.6e12
    assert 9e9 < scaling.chinchilla_params(1.23e22, 1) < 11.5e9


def test_allocations_obey_c_equals_6nd_and_approach_3_is_the_loss_minimum():
    c = 1e21
    rows = {r.law: r for r in scaling.allocations(c)}
    assert set(rows) == {"kaplan", "chinchilla-1", "chinchilla-2", "chinchilla-3"}
    for r in rows.values():
        assert math.isclose(6 * r.params * r.tokens, c, rel_tol=1e-9)
    best = rows["chinchilla-3"]
    for f in (0.5, 0.8, 1.25, 2.0):  # the closed form is the minimum of L along C = 6ND
        n = best.params * f
        assert scaling.CHINCHILLA.loss(n, c / (6 * n)) > best.loss
    assert rows["kaplan"].params > rows["chinchilla-1"].params  # Kaplan favours bigger models


def test_tokens_for_params_inverts_the_allocation():
    for approach in (1, 2, 3):
        n = 7e9
        d = scaling.tokens_for_params(n, approach)
        assert math.isclose(scaling.chinchilla_params(6 * n * d, approach), n, rel_tol=1e-6)
    assert 15 < scaling.tokens_for_params(1e9, 1) / 1e9 < 25  # ~20 tokens per parameter


def test_gpu_hours_budget():
    assert scaling.flops_from_gpu_hours(8, 10, 1e15, 0.5) == 8 * 36000 * 1e15 * 0.5


def test_fit_recovers_a_known_law():
    law = scaling.LossLaw(E=2.0, A=300.0, B=500.0, alpha=0.3, beta=0.35)
    points = [(n, d, law.loss(n, d)) for n in (1e6, 4e6, 1.6e7, 6.4e7) for d in (1e8, 1e9, 1e10)]
    fit = scaling.fit_loss_law(points)
    for n, d, loss in points:
        assert abs(fit.loss(n, d) - loss) / loss < 0.01
    assert abs(fit.loss(1e9, 1e11) - law.loss(1e9, 1e11)) / law.loss(1e9, 1e11) < 0.03  # extrapolates


def test_fit_refuses_too_few_or_bad_points():
    with pytest.raises(KilnError, match="at least 3"):
        scaling.fit_loss_law([(1e6, 1e8, 3.0)])
    with pytest.raises(KilnError, match="positive"):
        scaling.fit_loss_law([(1e6, 1e8, 3.0), (2e6, 1e8, -1.0), (4e6, 1e8, 2.0)])


def test_bad_budget():
    for c in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(KilnError, match="budget"):
            scaling.allocations(c)


def test_sweep_points_read_completed_trials(tmp_path):
    import json

    from kiln.config import load_config, to_toml

    trials = []
    for i, dim in enumerate((64, 128)):
        cfg = load_config(None, [f"model.dim={dim}", "model.n_layers=2", "model.vocab_size=300"])
        (tmp_path / f"trial-{i:03d}").mkdir()
        (tmp_path / f"trial-{i:03d}" / "config.toml").write_text(to_toml(cfg))
        trials.append({"trial": f"trial-{i:03d}", "status": "completed", "best_val_loss": 3.0 - i, "steps_done": 10})
    trials.append({"trial": "../escape", "status": "completed", "best_val_loss": 1.0, "steps_done": 10})
    trials.append({"trial": "trial-009", "status": "failed"})
    (tmp_path / "sweep.json").write_text(json.dumps({"trials": trials}))
    points = scaling.sweep_points(tmp_path)
    assert len(points) == 2 and points[0][0] < points[1][0] and points[0][1] == 10 * 16 * 256
    (tmp_path / "sweep.json").write_text("{not json")
    with pytest.raises(KilnError, match="not a kiln sweep"):
        scaling.sweep_points(tmp_path)
