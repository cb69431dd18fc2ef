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
