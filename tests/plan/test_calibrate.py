"""kiln/plan/calibrate.py: fitting a cluster to measured step times."""

from kiln.plan.calibrate import Measurement, fit_cluster, fit_error, predicted_step
from kiln.plan.cluster import load_cluster
from kiln.plan.memory import Layout, ModelShape


def _case(step_s: float) -> Measurement:
    shape = ModelShape(dim=64, n_layers=2, n_heads=2, kv_dim=64, ffn=128, gated=False, vocab=256, tied=True)
    layout = Layout(dp_replicate=2, dp_mode="ddp", micro_batch=2, precision="fp32")
    return Measurement("ddp x2", shape, layout, 32, step_s)


def test_fixed_overlap_is_kept_and_fit_tracks_the_measurement():
    cluster = load_cluster("cpu-local")
    for step_s in (0.05, 0.5):
        fitted = fit_cluster(cluster, [_case(step_s)], overlap=0.0)
        assert fitted.overlap_efficiency == 0.0
        predicted = predicted_step(_case(step_s), fitted)
        assert abs(predicted / step_s - 1) < 0.15, (step_s, predicted)
        assert fit_error(fitted, [_case(step_s)]) < fit_error(cluster, [_case(step_s)])
