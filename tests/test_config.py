"""Config schema: defaults, overrides, and errors that name the key."""

import pytest

from nearpolicy.config import Config, ConfigError, load_config


def test_defaults_load_without_a_file():
    cfg = load_config(None)
    assert cfg == Config()
    assert cfg.engine.precision == "q8_0" and cfg.engine.kind == "llamacpp"


def test_overrides_are_typed_and_nested(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[run]\nname = "x"\n[algorithm]\nlr = 1e-5\n')
    cfg = load_config(path, ["run.steps=3", "sampling.top_p=0.9", "engine.precision=q4_1", "task.options={min_terms=3}"])
    assert (cfg.run.name, cfg.run.steps, cfg.algorithm.lr) == ("x", 3, 1e-5)
    assert cfg.sampling.top_p == 0.9 and cfg.engine.precision == "q4_1" and cfg.task.options == {"min_terms": 3}


@pytest.mark.parametrize("override,needle", [
    ("algorithm.lrr=1", "unknown key 'algorithm.lrr'"),
    ("bogus.x=1", "unknown key 'bogus'"),
    ("sampling.temperature=0", "sampling.temperature"),
    ("sampling.top_p=1.5", "sampling.top_p"),
    ("sampling.top_k=-2", "sampling.top_k"),
    ("engine.precision=q3_k", "engine.precision"),
    ("algorithm.group_size=0", "algorithm.group_size"),
    ("algorithm.minibatches=3", "minibatches"),
    ("run.name=a/b", "run.name"),
    ("task.kind=jsonl", "task.path"),
])
def test_bad_values_name_the_key(override, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.").replace("(", r"\(")):
        load_config(None, [override])


def test_malformed_toml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[run\nname=")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.toml")


def test_override_without_equals_is_rejected():
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["run.steps"])


def test_main_job_config_is_the_embedded_defaults():
    from pathlib import Path

    main = load_config(Path(__file__).parent.parent / "configs" / "main.toml")
    defaults = load_config(None)
    assert main.model_copy(update={"correction": defaults.correction}) == defaults
    assert main.correction.spec() == defaults.correction.spec()


def test_correction_overrides_replace_preset_fields_and_bad_bounds_name_the_section():
    cfg = load_config(None, ["correction.preset=token_mis", "correction.upper=3.0"])
    spec = cfg.correction.spec()
    assert (spec.level, spec.action, spec.lower, spec.upper) == ("token", "mask", 0.5, 3.0)
    with pytest.raises(ConfigError, match="correction"):
        load_config(None, ["correction.preset=token_mis", "correction.lower=5.0"])
