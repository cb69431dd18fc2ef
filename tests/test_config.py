import pytest

from kiln.config import JobConfig, apply_overrides, from_dict, load_config, to_toml
from kiln.errors import ConfigError


def test_defaults_validate():
    cfg = load_config(None)
    assert cfg.model.norm == "rmsnorm" and cfg.data.source == "builtin:stdlib"


def test_overrides_parse_toml_literals():
    cfg = load_config(None, ["optim.lr=1e-3", "train.steps=7", "model.tie_embeddings=false",
                             "optim.betas=[0.8, 0.9]", "data.source=some/path.txt",
                             "train.eval_sets=['a.txt', 'b.txt']"])
    assert cfg.optim.lr == 1e-3 and cfg.train.steps == 7 and cfg.model.tie_embeddings is False
    assert cfg.optim.betas == (0.8, 0.9) and cfg.data.source == "some/path.txt"
    assert cfg.train.eval_sets == ["a.txt", "b.txt"]


def test_int_accepted_for_float():
    cfg = load_config(None, ["optim.lr=1"])
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)


@pytest.mark.parametrize("override, message", [
    ("optim.lrr=1", "unknown key optim.lrr"),
    ("optimizer.lr=1", "unknown section [optimizer]"),
    ("train.steps=abc", "train.steps='abc' has the wrong type; expected int"),
    ("train.steps=0", "train.steps=0 must be > 0"),
    ("model.norm=batchnorm", "model.norm='batchnorm' is not one of"),
    ("model.dim=102", "divisible by model.n_heads"),
    ("data.seq_len=4096", "exceeds model.max_seq_len"),
    ("train.autotune=true", "train.autotune=true needs train.compile=true"),
    ("novalue", "expected section.key=value"),
])
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(ConfigError, match=None) as e:
        load_config(None, [override])
    assert message in str(e.value)


def test_bad_file(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("[model]\ndim = 'big'\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert str(p) in str(e.value) and "model.dim" in str(e.value)
    p.write_text("[model\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(p)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.toml")


def test_toml_round_trip(tmp_path):
    cfg = load_config(None, ["model.dim=512", "optim.name=lion"])
    p = tmp_path / "resolved.toml"
    p.write_text(to_toml(cfg))
    again = load_config(p)
    assert again == cfg


def test_from_dict_rejects_non_table():
    with pytest.raises(ConfigError, match="must be a table"):
        from_dict({"model": 3})


def test_apply_overrides_in_place():
    cfg = JobConfig()
    apply_overrides(cfg, ["model.dropout=0.1"])
    assert cfg.model.dropout == 0.1


# Issue 10: each of these once gave a traceback, or was accepted and ran into NaN or nonsense.
@pytest.mark.parametrize("override, message", [
    ("model.n_kv_heads=-2", "model.n_kv_heads=-2 must be >= 0"),
    ("model.ffn_hidden=-5", "model.ffn_hidden=-5 must be >= 0"),
    ("train.threads=-1", "train.threads=-1 must be in [0, 4096]"),
    ("model.init_std=-1", "model.init_std=-1.0 must be in (0, 1]"),
    ("optim.lr=nan", "optim.lr=nan must be a finite number"),
    ("optim.lr=inf", "optim.lr=inf must be a finite number"),
    ("optim.lr=-inf", "optim.lr=-inf must be a finite number"),
    ("optim.weight_decay=nan", "optim.weight_decay=nan must be a finite number"),
    ("train.device=bogus", "train.device='bogus' must be auto, cpu, cuda or cuda:N"),
    ("train.device='cuda:x'", "train.device='cuda:x' must be auto, cpu, cuda or cuda:N"),
    ("data.vocab_size=1000000000", "data.vocab_size=1000000000 must be in (0, 16777216]"),
    ("model.vocab_size=1000000000", "model.vocab_size=1000000000 must be in [0, 16777216]"),
    ("model.norm_eps=-1", "model.norm_eps=-1.0 must be in (0, 1)"),
    ("model.rope_theta=0", "model.rope_theta=0.0 must be > 0"),
    ("model.rope_theta=-5", "model.rope_theta=-5.0 must be > 0"),
    ("train.eval_every=-1", "train.eval_every=-1 must be >= 0"),
    ("data.prefetch=-3", "data.prefetch=-3 must be in [1, 1024]"),
    ("metrics.peak_flops=-1", "metrics.peak_flops=-1.0 must be >= 0"),
    ("train.grad_accum=1000000", "train.grad_accum=1000000 must be in [1, 65536]"),
    ("train.seed=99999999999999999999", "train.seed=99999999999999999999 does not fit in 64 bits"),
    ("optim.betas=[0.9, nan]", "optim.betas=nan must be a finite number"),
    ("optim.betas=[0.9, 1.5]", "optim.betas=1.5 must be in [0, 1)"),
    ("schedule.plateau_patience=0", "schedule.plateau_patience=0 must be > 0"),
    ("parallel.dp_shard=0", "parallel.dp_shard=0 must be -1 (auto) or >= 1"),
    ("parallel.dp_shard=-2", "parallel.dp_shard=-2 must be >= -1"),
    ("train.steps=true", "train.steps=True has the wrong type; expected int"),
    ("model.rope_scaling=longrope", "model.rope_scaling='longrope' is not one of none, linear, llama3, yarn"),
    ("model.rope_scaling_factor=0.5", "model.rope_scaling_factor=0.5 must be >= 1"),
])
def test_out_of_range_values_name_the_key(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert message in str(e.value)


@pytest.mark.parametrize("overrides, message", [
    (["model.positions=learned", "model.rope_scaling=linear"], "model.rope_scaling='linear' needs model.positions='rope'"),
    (["model.rope_scaling=llama3", "model.rope_low_freq_factor=4", "model.rope_high_freq_factor=4"],
     "model.rope_high_freq_factor=4 must be > model.rope_low_freq_factor=4"),
    (["model.rope_scaling=yarn", "model.rope_yarn_beta_fast=1"],
     "model.rope_yarn_beta_fast=1 must be > model.rope_yarn_beta_slow=1 for rope_scaling='yarn'"),
    (["model.dim=30", "model.n_heads=4"], "model.dim=30 must be divisible by model.n_heads=4 (or set model.head_dim)"),
    (["model.head_dim=7"], "model.head_dim=7 must be even for rope positions"),
])
def test_attention_shapes_that_cannot_apply_are_refused(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert message in str(e.value)


@pytest.mark.parametrize("name", ["../../etc", "a/b", ".hidden", "", "x" * 200, "a\nb"])
def test_run_name_cannot_leave_the_runs_directory(name):
    # model.name is the default run dir runs/NAME: it must stay one plain path component.
    with pytest.raises(ConfigError, match="model.name=.* must be a plain name"):
        load_config(None, [f"model.name={name!r}"])


def test_valid_device_names():
    for device in ("auto", "cpu", "cuda", "cuda:1"):
        assert load_config(None, [f"train.device={device!r}"]).train.device == device


def test_non_finite_numbers_in_a_toml_file_name_file_and_key(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("[optim]\nlr = nan\n")
    with pytest.raises(ConfigError, match=f"{p}: optim.lr=nan must be a finite number"):
        load_config(p)


def test_python_built_configs_are_checked_by_validate():
    cfg = JobConfig()
    cfg.optim.lr = float("inf")
    with pytest.raises(ConfigError, match="optim.lr=inf must be a finite number"):
        cfg.validate()


def test_one_engine_parses_values_for_every_command():
    from kiln.config import parse_literal
    from kiln.train.sweep import parse_value
    from kiln.prep import pipeline

    assert parse_value is parse_literal
    assert parse_literal("1e-3") == 1e-3 and parse_literal("[1, 2]") == [1, 2] and parse_literal("x/y") == "x/y"
    assert not hasattr(pipeline, "tomllib") and not hasattr(pipeline, "coerce")


def test_hostile_keys_still_give_one_line(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('["sec\\nx"]\na = 1\n[model]\n"k\\ney" = 1\n')
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert "\n" not in str(e.value) and "sec\\nx" in str(e.value)
    p.write_text('[model]\n"k\\ney" = 1\n')
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert "\n" not in str(e.value) and "model.k\\ney" in str(e.value)


def test_deeply_nested_toml_is_a_config_error_not_a_recursion_traceback(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("[model]\ndim = " + "[" * 100_000 + "\n")
    with pytest.raises(ConfigError, match="nested too deeply"):
        load_config(p)
    with pytest.raises(ConfigError, match="model.dim=.* has the wrong type; expected int"):
        load_config(None, ["model.dim=" + "[" * 100_000])


def test_head_dim_frees_the_head_width_from_dim():
    cfg = load_config(None, ["model.dim=30", "model.n_heads=4", "model.head_dim=8"]).model
    assert cfg.attention_head_dim() == 8 and load_config(None, []).model.attention_head_dim() == 256 // 4


def test_global_batch_size_derives_grad_accum_for_each_layout():
    train = load_config(None, ["train.batch_size=4", "train.global_batch_size=32"]).train
    assert [train.accumulation(ranks) for ranks in (1, 2, 4, 8)] == [8, 4, 2, 1]
    plain = load_config(None, ["train.batch_size=4", "train.grad_accum=3"]).train
    assert plain.accumulation(8) == 3  # 0: the batch is batch_size x grad_accum x ranks, as set
    with pytest.raises(ConfigError, match=r"train.global_batch_size=32 is not a multiple of train.batch_size=4 x 16 "
                                          r"data-parallel ranks = 64; change train.global_batch_size"):
        train.accumulation(16)
    with pytest.raises(ConfigError, match=r"train.global_batch_size=6 is not a multiple of train.batch_size=4"):
        load_config(None, ["train.batch_size=4", "train.global_batch_size=6"])
    huge = load_config(None, ["train.batch_size=1", f"train.global_batch_size={65537 * 2}"]).train
    with pytest.raises(ConfigError, match=r"131074 micro-batches .* \(at most 65536\); raise train.batch_size"):
        huge.accumulation(1)
