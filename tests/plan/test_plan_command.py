from kiln.cli import main
from kiln.config import load_config
from calibration_runs import write_calibration_runs


def _err(capsys):
    return capsys.readouterr().err.strip().splitlines()


def test_plan_writes_a_config_kiln_train_reads(tmp_path, capsys):
    out = tmp_path / "plan.toml"
    rc = main(["plan", "--cluster", "h100", "--nodes", "2", "--budget-flops", "1e21", "--global-batch", "256",
               "--set", "data.seq_len=2048", "--set", "model.max_seq_len=2048", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0 and "chinchilla-3" in text and "Young/Daly interval" in text and "cost ~$" in text
    cfg = load_config(out)
    world = cfg.parallel.dp_replicate * cfg.parallel.dp_shard * cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp
    assert world == 16 and cfg.train.steps > 1 and 1 <= cfg.checkpoint.every <= cfg.train.steps
    assert 1e9 < 1e21 / 6 / (cfg.train.steps * 256 * 2048) < 3e9  # the Chinchilla model size was planned


def test_budget_too_small(tmp_path, capsys):
    rc = main(["plan", "--budget-flops", "1e9", "--out", str(tmp_path / "p.toml")])
    err = _err(capsys)
    assert rc == 2 and len(err) == 1 and "too small" in err[0] and "needs about" in err[0]
    assert not (tmp_path / "p.toml").exists()


def test_unknown_hardware(tmp_path, capsys):
    rc = main(["plan", "--cluster", "tpu-v9", "--out", str(tmp_path / "p.toml")])
    err = _err(capsys)
    assert rc == 2 and len(err) == 1 and "presets: a100" in err[0]


def test_nothing_fits_names_what_would(tmp_path, capsys):
    rc = main(["plan", "--cluster", "a100", "--set", "model.dim=16384", "--set", "model.n_layers=120",
               "--set", "model.n_heads=128", "--out", str(tmp_path / "p.toml")])
    err = _err(capsys)
    assert rc == 2 and len(err) == 1 and "nothing fits" in err[0] and "--nodes" in err[0]
    assert not (tmp_path / "p.toml").exists()


def test_calibrate_fits_measured_runs_and_writes_a_loadable_cluster(tmp_path, capsys):
    from kiln.plan.calibrate import measured_run, predicted_step
    from kiln.plan.cluster import load_cluster

    truth = load_cluster("cpu-local")
    truth.device.max_efficiency, truth.device.half_efficiency_work = 0.3, 5e4
    runs = write_calibration_runs(tmp_path, truth, ((64, 2), (128, 4), (256, 8)))
    out = tmp_path / "cal.toml"
    rc = main(["plan", "--cluster", "cpu-local", "--calibrate", *runs, "--calibrated-out", str(out)])
    assert rc == 0, capsys.readouterr().err
    fitted = load_cluster(str(out))
    for r in runs:
        m = measured_run(r)
        assert abs(predicted_step(m, fitted) / m.step_s - 1) < 0.1
    rc = main(["plan", "--cluster", "cpu-local", "--calibrate", str(tmp_path / "nope")])
    assert rc == 2 and "not found" in capsys.readouterr().err


def test_plan_keeps_bf16_gradient_reductions_and_weighs_their_bytes(tmp_path, capsys):
    out = tmp_path / "plan.toml"
    argv = ["plan", "--cluster", "h100", "--nodes", "2", "--budget-flops", "1e21", "--global-batch", "256",
            "--set", "data.seq_len=2048", "--set", "model.max_seq_len=2048", "--out", str(out)]
    assert main(argv + ["--set", "parallel.reduce_dtype='bf16'"]) == 0
    text = capsys.readouterr().out
    assert load_config(out).parallel.reduce_dtype == "bf16" and "grad_wire_bytes=2" in text


def test_as_configured_predicts_the_configs_own_layout(tmp_path, capsys):
    """--as-configured: kiln train's checks at the cluster's world size, then the config's layout's
    memory and step time from the same models the search ranks by, next to the search's fastest."""
    from kiln.plan.cluster import load_cluster
    from kiln.plan.memory import Layout, ModelShape, rank_memory, vocab_estimate
    from kiln.plan.search import search
    from kiln.plan.timing import step_time

    sets = ["--set", "model.dim=1024", "--set", "model.n_layers=16", "--set", "model.n_heads=16",
            "--set", "data.seq_len=2048", "--set", "model.max_seq_len=2048", "--set", "train.batch_size=4",
            "--set", "train.global_batch_size=256", "--set", "train.dtype=bf16"]
    out = tmp_path / "p.toml"
    rc = main(["plan", "--cluster", "h100", "--nodes", "2", "--as-configured", "--out", str(out), *sets,
               "--set", "parallel.tp=2", "--set", "parallel.dp_mode=fsdp", "--set", "train.activation_checkpointing=full"])
    text = capsys.readouterr().out
    assert rc == 0 and not out.exists()  # a check: nothing written
    assert "dp=1x8(fsdp) tp=2 mb=4 ga=8 ac=full" in text  # grad_accum derived: 256 / (4 x 8)
    cfg = load_config(None, [s for s in sets if s != "--set"])
    shape = ModelShape.from_config(cfg.model, vocab_estimate(cfg)[0])
    cluster = load_cluster("h100", 2, None)
    best = search(shape, cluster, 2048, 256, top=1)[0]
    assert f"the search's fastest at this batch: {best.layout.describe()}, step {best.time.total:.4g} s" in text
    layout = Layout(dp_shard=8, tp=2, dp_mode="fsdp", micro_batch=4, grad_accum=8, ac="full", precision="bf16")
    assert f"step {step_time(shape, layout, 2048, cluster).total:.4g} s" in text
    assert f"total {rank_memory(shape, layout, 2048).total / 2**30:,.2f} GiB" in text
    # what kiln train refuses is its one line; what does not fit exits 1
    rc = main(["plan", "--cluster", "h100", "--nodes", "2", "--as-configured", *sets, "--set", "parallel.tp=3"])
    err = _err(capsys)
    assert rc == 2 and len(err) == 1 and "parallel.cp*tp*pp=3" in err[0]
    rc = main(["plan", "--cluster", "h100", "--nodes", "1", "--as-configured", *sets, "--set", "model.n_layers=200",
               "--set", "parallel.dp_mode=ddp"])
    assert rc == 1 and "does NOT fit" in capsys.readouterr().out
