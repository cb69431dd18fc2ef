import pytest

from kiln.prep.pipeline import PrepConfig, apply_overrides, config_from_dict, load_prep_config
from kiln.prep.quality import GopherQuality
from kiln.prep.readers import ReaderConfig
from kiln.errors import ConfigError

TOML = """
[input]
path = "raw"
[output]
dir = "out"
[[step]]
type = "gopher_quality"
min_words = 10
[[step]]
type = "pii"
name = "redact"
types = ["EMAIL"]
"""


def test_load_steps_and_overrides(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text(TOML, encoding="utf-8")
    cfg = load_prep_config(path, ["step.1.min_words=7", "step.redact.types=['EMAIL', 'IP_ADDRESS']",
                                  "run.workers=3", "tokenize.tokenizer=byte"])
    assert [s.name for s in cfg.steps] == ["gopher_quality", "redact"]
    assert isinstance(cfg.steps[0], GopherQuality) and cfg.steps[0].config.min_words == 7
    assert cfg.steps[1].config.types == ["EMAIL", "IP_ADDRESS"]
    assert cfg.run.workers == 3 and cfg.tokenize.tokenizer == "byte"
    assert cfg.describe()["steps"][1]["name"] == "redact"


@pytest.mark.parametrize("raw, message", [
    ({"inputs": {}}, "unknown section [inputs]"),
    ({"input": {"path": "x", "txt_field": "t"}}, "unknown key input.txt_field"),
    ({"input": {"path": 5}}, "cfg.toml: input.path=5 has the wrong type"),
    ({"step": [{"type": "gopher"}]}, "unknown step type 'gopher'"),
    ({"step": [{"min_words": 3}]}, "missing key 'type'"),
    ({"step": [{"type": "gopher_quality", "min_word": 3}]}, "[[step]] #1 (gopher_quality): unknown key min_word"),
    ({"step": [{"type": "pii", "types": "EMAIL"}]}, "types='EMAIL' has the wrong type; expected list"),
])
def test_config_errors_name_the_key(raw, message):
    with pytest.raises(ConfigError) as e:
        config_from_dict(raw, "cfg.toml")
    assert message in str(e.value) and "cfg.toml" in str(e.value)


def test_validation_and_override_errors():
    cfg = config_from_dict({"input": {"path": "x"}, "step": [{"type": "pii"}, {"type": "pii"}]})
    with pytest.raises(ConfigError, match="unique"):
        cfg.validate()
    with pytest.raises(ConfigError, match="input.path is required"):
        PrepConfig().validate()
    with pytest.raises(ConfigError, match="run.executor"):
        config_from_dict({"input": {"path": "x"}, "run": {"executor": "spark"}}).validate()
    with pytest.raises(ConfigError, match="no step 'nope'"):
        apply_overrides(cfg, ["step.nope.types=[]"])
    with pytest.raises(ConfigError, match="expected section.key=value"):
        apply_overrides(cfg, ["workers"])


def test_python_api_takes_step_objects():
    cfg = PrepConfig(input=ReaderConfig(path="raw"), steps=[GopherQuality()]).validate()
    assert cfg.describe()["steps"][0]["type"] == "gopher_quality"
