"""kiln/plan/calibrate.py: fitting a cluster to measured step times and timed collectives."""

import copy

import pytest

from kiln.errors import KilnError
from kiln.plan.calibrate import (CollectiveSample, Measurement, fit_cluster, fit_error, fit_link,
                                 predicted_step)
from kiln.plan.cluster import load_cluster
from kiln.plan.memory import Layout, ModelShape
from kiln.plan.timing import all_gather, all_reduce, broadcast, reduce_scatter

SHAPE = ModelShape(dim=64, n_layers=2, n_heads=2, kv_dim=64, ffn=128, gated=False, vocab=256, tied=True)


def _case(step_s: float, mode: str = "ddp", world: int = 2, mb: int = 2) -> Measurement:
    if mode in ("ddp", "zero1") or world == 1:
        layout = Layout(dp_replicate=world, dp_mode=mode, micro_batch=mb, precision="fp32")
    else:
        layout = Layout(dp_shard=world, dp_mode=mode, micro_batch=mb, precision="fp32")
    return Measurement(f"{mode} x{world}", SHAPE, layout, 32, step_s)


def test_fixed_overlap_is_kept_and_fit_tracks_the_measurement():
    cluster = load_cluster("cpu-local")
    for step_s in (0.05, 0.5):
        fitted = fit_cluster(cluster, [_case(step_s)], overlap=0.0)
        assert fitted.overlap_efficiency == 0.0
        predicted = predicted_step(_case(step_s), fitted)
        assert abs(predicted / step_s - 1) < 0.05, (step_s, predicted)
        assert fit_error(fitted, [_case(step_s)]) < fit_error(cluster, [_case(step_s)])


def _samples(cluster):
    ops = {"all_reduce": all_reduce, "all_gather": all_gather, "reduce_scatter": reduce_scatter, "broadcast": broadcast}
    return [CollectiveSample(op, n, size, fn(cluster, n, size))
            for op, fn in ops.items() for n in (2, 4) for size in (2**14, 2**20, 2**24)]


def test_fit_link_recovers_latency_and_bandwidth_of_timed_collectives():
    truth = load_cluster("cpu-local")
    truth.intra_node.latency_us, truth.intra_node.bandwidth_gbps = 250.0, 0.8
    start = load_cluster("cpu-local")  # 100 us, 1 GB/s, 10 GB/s memory
    start.cores_per_node = 2.0
    # copies on every rank at once: 4 ranks on 2 cores take twice as long for the same bandwidth
    copies = [CollectiveSample("copy", n, size, 2 * size / 6e9 * max(1, n / 2)) for n in (2, 4) for size in (2**20, 2**24)]
    fitted = fit_link(start, _samples(truth) + copies)
    assert fitted.intra_node.latency_us == pytest.approx(250.0, rel=1e-6)
    assert fitted.intra_node.bandwidth_gbps == pytest.approx(0.8, rel=1e-6)
    assert fitted.device.memory_bandwidth_gbps == pytest.approx(6.0, rel=1e-6)
    assert start.intra_node.latency_us == 100.0  # the input is not changed
    with pytest.raises(KilnError, match="two or more sizes"):
        fit_link(start, [CollectiveSample("all_reduce", 2, 1024, 1e-3)])
    with pytest.raises(KilnError, match="unknown op 'gather'"):
        fit_link(start, [CollectiveSample("gather", 2, 1024, 1e-3), CollectiveSample("gather", 4, 1024, 1e-3)])


def test_fit_with_timed_collectives_recovers_the_launch_cost_and_oversubscription():
    """Step times made by a known cluster (2 cores shared by up to 4 processes, 1 ms per
    collective launch) are explained by the fit within 5%; a fit that ignored the launch cost
    (the previous model) cannot match FSDP's many collectives and DDP's few at once."""
    truth = load_cluster("cpu-local")
    truth.cores_per_node, truth.gpus_per_node, truth.overlap_efficiency = 2.0, 4, 0.0
    truth.collective_launch_us = 1000.0
    truth.device.max_efficiency, truth.device.half_efficiency_work = 0.3, 5e3
    layouts = [("ddp", 1, 8), ("ddp", 2, 4), ("zero1", 2, 4), ("fsdp", 2, 4), ("zero2", 2, 4), ("ddp", 4, 2),
               ("fsdp", 4, 2)]
    cases = [_case(1.0, m, w, mb) for m, w, mb in layouts]
    cases = [Measurement(c.name, c.shape, c.layout, c.seq_len, predicted_step(c, truth)) for c in cases]
    start = copy.deepcopy(truth)
    start.collective_launch_us, start.device.max_efficiency = 0.0, 0.5
    fitted = fit_cluster(start, cases, links=_samples(truth))
    for c in cases:
        assert predicted_step(c, fitted) == pytest.approx(c.step_s, rel=0.05), c.name
    assert 300.0 <= fitted.collective_launch_us <= 3000.0
    no_launch = fit_cluster(start, cases, overlap=0.0)  # no timed collectives: launch cost stays 0
    assert no_launch.collective_launch_us == 0.0
    assert fit_error(no_launch, cases) > 10 * fit_error(fitted, cases)


def test_a_pipeline_bubble_on_shared_cores_is_filled_by_the_other_stages():
    """pp ranks idle in the bubble leave their cores to the node's other processes: with 4 stages on
    2 cores the step is the node's work over its cores (no bubble term) as long as the full-speed
    pipeline (compute at a whole core plus its bubble) is shorter; with a core each, the bubble is
    the usual (pp-1)/m of compute."""
    from kiln.plan.timing import step_time

    shape = ModelShape(dim=64, n_layers=4, n_heads=4, kv_dim=64, ffn=256, gated=True, vocab=256, tied=False)
    cluster = load_cluster("cpu-local")
    cluster.cores_per_node = 4.0
    own = step_time(shape, Layout(pp=4, grad_accum=4), 32, cluster)
    assert own.bubble == pytest.approx(own.compute * 3 / 4)
    cluster.cores_per_node = 2.0
    shared = step_time(shape, Layout(pp=4, grad_accum=4), 32, cluster)
    assert shared.compute == pytest.approx(2 * own.compute)  # half a core each
    assert shared.bubble == 0.0  # full speed with its bubble: 1.75 x own.compute < 2 x own.compute
    few = step_time(shape, Layout(pp=4, grad_accum=1), 32, cluster)  # bubble 3x compute: it shows
    assert few.bubble == pytest.approx(few.compute * 0.5 * 4 - few.compute)
