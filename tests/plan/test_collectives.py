"""kiln/plan/collectives.py and `kiln plan --time-collectives / --collectives`: timing gloo collectives
over 2 spawned processes, fitting the link to them, and refusing bad sample files in one line."""

import json

import pytest

from kiln.cli import main
from kiln.plan.calibrate import fit_link
from kiln.plan.cluster import load_cluster
from kiln.plan.collectives import OPS, read_collectives
from calibration_runs import write_calibration_runs


def _err(capsys):
    return capsys.readouterr().err.strip().splitlines()


def test_time_collectives_on_two_gloo_processes_writes_samples_and_a_fitted_cluster(tmp_path, capsys):
    samples, out = tmp_path / "coll.json", tmp_path / "cal.toml"
    rc = main(["plan", "--cluster", "cpu-local", "--time-collectives", "2", "--collective-backend", "gloo",
               "--collectives-out", str(samples), "--calibrated-out", str(out)])
    assert rc == 0, capsys.readouterr().err
    rows = json.loads(samples.read_text())
    assert {r["op"] for r in rows} == set(OPS) and {r["ranks"] for r in rows} == {2}
    assert len({r["bytes"] for r in rows}) == 4 and all(r["seconds"] > 0 for r in rows)
    # bigger tensors take longer: the link has a bandwidth, not only a latency
    big, small = max(r["bytes"] for r in rows), min(r["bytes"] for r in rows)
    ar = {r["bytes"]: r["seconds"] for r in rows if r["op"] == "all_reduce"}
    assert ar[big] > ar[small]
    fitted = load_cluster(str(out))
    assert fitted.backend == "gloo" and fitted.intra_node.bandwidth_gbps > 0 and fitted.intra_node.latency_us >= 0
    again = fit_link(load_cluster("cpu-local"), read_collectives(samples))
    assert again.intra_node.bandwidth_gbps == pytest.approx(fitted.intra_node.bandwidth_gbps)
    assert again.intra_node.latency_us == pytest.approx(fitted.intra_node.latency_us)


def test_collectives_file_fits_a_known_link(tmp_path, capsys):
    from kiln.plan.timing import all_gather, all_reduce, broadcast, reduce_scatter

    truth = load_cluster("cpu-local")
    truth.intra_node.latency_us, truth.intra_node.bandwidth_gbps = 300.0, 2.5
    fns = {"all_reduce": all_reduce, "all_gather": all_gather, "reduce_scatter": reduce_scatter,
           "broadcast": broadcast}
    rows = [{"op": op, "ranks": n, "bytes": b, "seconds": fn(truth, n, b)}
            for op, fn in fns.items() for n in (2, 4) for b in (2**14, 2**22)]
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"collectives": rows}))  # benchmarks/parallel_memory.py's layout
    out = tmp_path / "cal.toml"
    assert main(["plan", "--cluster", "cpu-local", "--collectives", str(path), "--calibrated-out", str(out)]) == 0
    fitted = load_cluster(str(out))
    assert fitted.intra_node.latency_us == pytest.approx(300.0, rel=1e-6)
    assert fitted.intra_node.bandwidth_gbps == pytest.approx(2.5, rel=1e-6)


BAD = [
    ("{not json", "not JSON"),
    ("[]", "non-empty list"),
    ('[{"op": "gather", "ranks": 2, "bytes": 16, "seconds": 0.1}]', "collectives[0]: op 'gather'"),
    ('[{"op": "all_reduce", "ranks": 2, "bytes": 16}]', "collectives[0]: seconds None"),
    ('[{"op": "all_reduce", "ranks": 2, "bytes": 16, "seconds": 0.1}, 7]', "collectives[1]: expected a table"),
    ('[{"op": "broadcast", "ranks": 1, "bytes": 16, "seconds": 0.1}]', "expected ranks >= 2"),
    ('[{"op": "copy", "ranks": 2, "bytes": -4, "seconds": 0.1}]', "bytes -4"),
    ('[{"op": "all_reduce", "ranks": 2, "bytes": 16, "seconds": 0.1}]', "two or more sizes"),
]


@pytest.mark.parametrize("text,message", BAD)
def test_bad_collectives_file_is_one_line_and_writes_nothing(tmp_path, capsys, text, message):
    path, out = tmp_path / "c.json", tmp_path / "cal.toml"
    path.write_text(text)
    rc = main(["plan", "--cluster", "cpu-local", "--collectives", str(path), "--calibrated-out", str(out)])
    err = _err(capsys)
    assert rc == 2 and len(err) == 1 and message in err[0], err
    assert not out.exists()


def test_bad_time_collectives_arguments(tmp_path, capsys):
    out = tmp_path / "cal.toml"
    for arg, message in (("two", "expected process counts"), ("1", "2 or more processes")):
        rc = main(["plan", "--cluster", "cpu-local", "--time-collectives", arg, "--calibrated-out", str(out)])
        err = _err(capsys)
        assert rc == 2 and len(err) == 1 and message in err[0], err
    rc = main(["plan", "--cluster", "cpu-local", "--collectives", str(tmp_path / "none.json")])
    assert rc == 2 and "not found" in _err(capsys)[0]
    assert not out.exists()


def test_calibrate_runs_with_a_collectives_file_fits_link_then_runs(tmp_path, capsys):
    """`--calibrate RUN_DIR... --collectives FILE`: the link from the timed collectives, the
    efficiency curve from the runs' step times (single-process runs made by a known device)."""
    from kiln.plan.calibrate import measured_run, predicted_step
    from kiln.plan.timing import all_reduce

    truth = load_cluster("cpu-local")
    truth.intra_node.latency_us, truth.intra_node.bandwidth_gbps = 150.0, 3.0
    truth.device.max_efficiency, truth.device.half_efficiency_work = 0.3, 5e4
    rows = [{"op": "all_reduce", "ranks": n, "bytes": b, "seconds": all_reduce(truth, n, b)}
            for n in (2, 4) for b in (2**14, 2**22)]
    (tmp_path / "coll.json").write_text(json.dumps(rows))
    runs = write_calibration_runs(tmp_path, truth, ((64, 2), (256, 8)))
    out = tmp_path / "cal.toml"
    rc = main(["plan", "--cluster", "cpu-local", "--calibrate", *runs, "--collectives", str(tmp_path / "coll.json"),
               "--calibrated-out", str(out)])
    assert rc == 0, capsys.readouterr().err
    fitted = load_cluster(str(out))
    assert fitted.intra_node.latency_us == pytest.approx(150.0, rel=1e-6)
    assert fitted.intra_node.bandwidth_gbps == pytest.approx(3.0, rel=1e-6)
    for r in runs:
        m = measured_run(r)
        assert abs(predicted_step(m, fitted) / m.step_s - 1) < 0.1
