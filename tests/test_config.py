"""Config schema: defaults, overrides, and errors that name the key."""

import pytest

from nearpolicy.config.schema import Config, ConfigError, load_config


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


def test_a_config_nested_past_the_recursion_limit_is_refused_as_invalid(tmp_path):
    deep = tmp_path / "deep.toml"
    deep.write_text("x = " + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ConfigError, match="deep.toml: not valid TOML"):
        load_config(deep)
    deep_json = tmp_path / "deep.json"
    deep_json.write_text('{"x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ConfigError, match="deep.json: not valid JSON"):
        load_config(deep_json)


def test_an_error_names_the_set_layer_when_the_file_alone_is_valid(tmp_path):
    """New-user finding: `--set run.stpes=2` on configs/main.toml was reported as "configs/main.toml: invalid config"."""
    good, bad = tmp_path / "good.toml", tmp_path / "bad.toml"
    good.write_text("[run]\nsteps = 3\n")
    bad.write_text("[run]\nstpes = 3\n")
    with pytest.raises(ConfigError, match=r"^--set on .*good\.toml: invalid config: unknown key 'run\.stpes'"):
        load_config(good, ["run.stpes=2"])
    with pytest.raises(ConfigError, match=r"^\S*bad\.toml: invalid config: unknown key 'run\.stpes'"):
        load_config(bad, ["run.steps=2"])


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


def test_main_job_config_is_the_embedded_defaults_plus_its_lr_recipe():
    from pathlib import Path

    main = load_config(Path(__file__).parent.parent / "configs" / "main.toml")
    defaults = load_config(None)
    assert main.task.resolved_options() == defaults.task.resolved_options()
    recipe = {"lr": 1e-5, "lr_schedule": "cosine", "warmup_steps": 2}
    assert {key: getattr(main.algorithm, key) for key in recipe} == recipe
    assert (defaults.algorithm.lr, defaults.algorithm.lr_schedule, defaults.algorithm.warmup_steps) == (2e-5, "constant", 0)
    same = {"correction": defaults.correction, "task": main.task.model_copy(update={"options": None}),
            "algorithm": main.algorithm.model_copy(update={key: getattr(defaults.algorithm, key) for key in recipe})}
    assert main.model_copy(update=same) == defaults
    assert main.correction.spec() == defaults.correction.spec()


def test_correction_overrides_replace_preset_fields_and_bad_bounds_name_the_section():
    cfg = load_config(None, ["correction.preset=token_mis", "correction.upper=3.0"])
    spec = cfg.correction.spec()
    assert (spec.level, spec.action, spec.lower, spec.upper) == ("token", "mask", 0.5, 3.0)
    with pytest.raises(ConfigError, match="correction"):
        load_config(None, ["correction.preset=token_mis", "correction.lower=5.0"])


@pytest.mark.parametrize("override,needle", [
    ("run.name=..", "run.name"), ("run.seed=-1", "run.seed"), ("algorithm.lr=inf", "algorithm.lr"),
    ("algorithm.lr=10.0", "algorithm.lr"), ("sampling.temperature=1e-40", "sampling.temperature"),
    ("algorithm.adam_betas=[2.0, -1.0]", "adam_betas"), ("algorithm.kl_coef=nan", "algorithm.kl_coef"),
    ("correction.center=log_mean", "decoupled"),
    ("logging.progress=1", "'logging.progress': Input should be a valid boolean"),
    ("engine.extra_buffers='false'", "'engine.extra_buffers': Input should be a valid boolean"),
])
def test_hostile_values_found_by_the_adversarial_review_are_rejected(override, needle):
    extra = ["correction.mode='bypass'"] if "center" in override else []
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load_config(None, [override, *extra])


def test_task_options_default_per_dataset():
    assert load_config(None).task.resolved_options() == {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    assert load_config(None, ["task.name=leg_counting"]).task.resolved_options() == {}
    assert load_config(None, ["task.kind=jsonl", "task.path='x.jsonl'"]).task.resolved_options() == {}


def test_upper_bound_may_be_infinite():
    assert load_config(None, ["correction.preset=token_is", "correction.upper=inf"]).correction.upper == float("inf")


def test_sequence_level_loss_implies_or_requires_per_sequence_aggregation():
    """GSPO under token-mean would weigh each sequence by its length (issue 13, TRL #3823)."""
    assert load_config(None, ["algorithm.loss=gspo"]).algorithm.aggregation == "seq-mean-token-mean"
    assert load_config(None).algorithm.aggregation == "token-mean"
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        with pytest.raises(ConfigError, match=r"algorithm\.aggregation = '" + mode + "'.*gspo.*sequence-level") as err:
            load_config(None, ["algorithm.loss=gspo", f"algorithm.aggregation='{mode}'"])
        assert "Value error" not in str(err.value) and "(got {" not in str(err.value)  # no pydantic internals
    explicit = load_config(None, ["algorithm.loss=gspo", "algorithm.aggregation='seq-mean-token-mean'"])
    assert explicit == load_config(None, ["algorithm.loss=gspo"])


def test_kl_estimator_is_a_registered_name_and_the_sum_norm_constant_is_in_tokens():
    with pytest.raises(ConfigError, match=r"algorithm\.kl_estimator.*k3_is"):
        load_config(None, ["algorithm.kl_estimator=k4"])
    assert load_config(None, ["algorithm.kl_estimator='k3+'"]).algorithm.kl_estimator == "k3+"
    with pytest.raises(ConfigError, match=r"algorithm\.aggregation_constant"):
        load_config(None, ["algorithm.aggregation_constant=0.5"])


MAIN_TOML = __import__("pathlib").Path(__file__).parent.parent / "configs" / "main.toml"


@pytest.mark.parametrize("preset,bounds", [("icepop", (0.5, 5.0)), ("areal_cap", (0.0, 5.0)), ("token_mis", (0.5, 2.0))])
def test_a_preset_set_on_the_command_line_comes_with_its_own_bounds(preset, bounds):
    """main.toml sets tis with upper = 2.0; `--set correction.preset=icepop` must run IcePop on [0.5, 5]."""
    spec = load_config(MAIN_TOML, [f"correction.preset={preset}"]).correction.spec()
    assert (spec.lower, spec.upper) == bounds and spec.action == "mask"


def test_preset_fields_set_in_the_same_layer_stay(tmp_path):
    assert load_config(MAIN_TOML, ["correction.preset=icepop", "correction.upper=3.0"]).correction.spec().upper == 3.0
    assert load_config(MAIN_TOML, ["correction.preset=tis"]).correction.spec().upper == 2.0  # same preset: kept
    path = tmp_path / "c.toml"
    path.write_text('[correction]\npreset = "icepop"\nupper = 2.0\nproximal = "old"\n')
    assert load_config(path).correction.spec().upper == 2.0  # the file chose both
    cfg = load_config(path, ["correction.preset=seq_tis"])
    assert (cfg.correction.spec().level, cfg.correction.spec().upper, cfg.correction.upper) == ("sequence", 2.0, None)


def test_effective_correction_is_described_in_one_line():
    from nearpolicy.ops.correction_presets import describe_correction

    cfg = load_config(MAIN_TOML, ["correction.preset=icepop"])
    assert describe_correction(cfg.correction.preset, cfg.correction.spec()) == "icepop: token mask [0.5, 5], decoupled"
    off = load_config(None, ["correction.preset=none"]).correction
    assert describe_correction(off.preset, off.spec()) == "none: no IS weight, decoupled"


def test_max_parallel_sequences_is_bounded_by_llamacpps_limit():
    from nearpolicy.engines.llamacpp import LlamaCppEngine

    assert load_config(None, ["engine.max_parallel_sequences=256"]).engine.max_parallel_sequences == 256
    with pytest.raises(ConfigError, match=r"engine\.max_parallel_sequences = 257 exceeds llama\.cpp's limit of 256"):
        load_config(None, ["engine.max_parallel_sequences=257"])
    assert load_config(None, ["engine.kind=hf", "engine.max_parallel_sequences=512"]).engine.max_parallel_sequences == 512
    with pytest.raises(ValueError, match=r"engine\.max_parallel_sequences = 300 is outside llama\.cpp's range \[1, 256\]"):
        LlamaCppEngine("never-read.gguf", max_parallel_sequences=300)


def test_reward_timeout_is_validated():
    assert load_config(None).task.reward_timeout_s == 10.0
    for bad in ("0", "-1", "3601", "nan"):
        with pytest.raises(ConfigError, match=r"task\.reward_timeout_s"):
            load_config(None, [f"task.reward_timeout_s={bad}"])


def test_every_key_has_a_doc_and_nearpolicy_config_prints_each_with_default_and_range(capsys):
    from nearpolicy.cli import main
    from nearpolicy.config.reference import undocumented

    assert undocumented() == []
    assert main(["config"]) == 0
    out = capsys.readouterr().out
    keys = [f"{section}.{key}" for section, s in Config.model_fields.items() for key in s.annotation.model_fields]
    assert len(keys) == 153
    for key in keys:
        assert f"  {key} = " in out, key
    lines = out.splitlines()
    at = lines.index("  algorithm.clip_high = 0.28    [float; >= 0]")
    assert lines[at + 1].startswith("      Upper PPO clip")  # the doc under the key
    assert "  run.seed = 0    [int; >= 0, < 4294967296]" in lines
    assert '  correction.proximal = "old"    [choice; one of: old, ewma, a3po]' in lines
    assert "  algorithm.dual_clip = 3.0    [float | None; > 1]" in lines and "  distill.teacher = unset    [str | None]" in lines
    assert "mc_grpo_released" in out and "token_tis_veto" in out  # registry names, read from the registries


def test_choice_lists_and_defaults_have_one_source():
    """config/schema.py declares no list or default of its own where ops/, engines/, tasks/ or types.py hold one."""
    import typing

    from nearpolicy.config.reference import allowed
    from nearpolicy.engines.factory import ENGINES
    from nearpolicy.engines.gguf.export import PRECISIONS, QTYPES, TENSOR_PRECISIONS
    from nearpolicy.engines.hf import DTYPES
    from nearpolicy.engines.llamacpp import KV_CACHE_TYPES
    from nearpolicy.engines.vllm_child import DTYPES as VLLM_DTYPES
    from nearpolicy.ops.advantages import ADVANTAGES
    from nearpolicy.ops.correction_presets import CORRECTIONS
    from nearpolicy.ops.corrections import ACTIONS, LEVELS, MODES
    from nearpolicy.ops.kl import KL_ESTIMATORS
    from nearpolicy.ops.losses import POLICY_LOSSES, PolicyLossParams
    from nearpolicy.ops.masked import AGGREGATIONS
    from nearpolicy.ops.proximal import ADAPTIVE_MIXES, CENTERINGS
    from nearpolicy.ops.self_normalize import SELF_NORMALIZE
    from nearpolicy.ops.turn_credit import DEFAULT_ANSWER_FORMAT, TURN_CREDIT, TurnCreditParams
    from nearpolicy.model.ewma import PROXIMALS
    from nearpolicy.tasks.factory import TASK_KINDS
    from nearpolicy.types import SamplingParams

    def choices(section: str, key: str) -> list[str]:
        return allowed(Config.model_fields[section].annotation.model_fields[key]).removeprefix("one of: ").split(", ")

    expected = {("engine", "kind"): tuple(ENGINES), ("engine", "precision"): PRECISIONS,
                ("engine", "tensor_precision"): PRECISIONS, ("engine", "hf_dtype"): DTYPES,
                ("engine", "kv_cache"): KV_CACHE_TYPES, ("engine", "vllm_dtype"): VLLM_DTYPES,
                ("task", "kind"): TASK_KINDS,
                ("algorithm", "advantage"): ADVANTAGES.names(), ("algorithm", "loss"): POLICY_LOSSES.names(),
                ("algorithm", "aggregation"): AGGREGATIONS, ("algorithm", "kl_estimator"): KL_ESTIMATORS.names(),
                ("algorithm", "turn_credit"): TURN_CREDIT.names(),
                ("correction", "preset"): ["none", *CORRECTIONS.names()], ("correction", "level"): LEVELS,
                ("correction", "action"): ACTIONS, ("correction", "mode"): MODES,
                ("correction", "self_normalize"): SELF_NORMALIZE, ("correction", "proximal"): PROXIMALS,
                ("correction", "adaptive_mix"): ADAPTIVE_MIXES, ("correction", "center"): CENTERINGS}
    for (section, key), names in expected.items():
        assert choices(section, key) == list(names), (section, key)
    assert tuple(QTYPES) == TENSOR_PRECISIONS  # PRECISIONS adds the K-quants (tests/test_gguf_kquant.py)
    cfg, loss, sampling = Config(), PolicyLossParams(), SamplingParams()
    a, s = cfg.algorithm, cfg.sampling
    assert (a.clip_low, a.clip_high, a.dual_clip, a.kl_coef, a.kl_estimator) == (
        loss.clip_low, loss.clip_high, loss.dual_clip, loss.kl_coef, loss.kl_estimator) == (0.2, 0.28, 3.0, 0.0, "k3_is")
    assert (s.temperature, s.top_p, s.top_k, s.max_new_tokens) == (
        sampling.temperature, sampling.top_p, sampling.top_k, sampling.max_new_tokens) == (1.0, 1.0, 0, 64)
    assert typing.get_args(Config.model_fields["engine"].annotation.model_fields["precision"].annotation) == PRECISIONS
    assert (a.turn_credit, a.trace_weight, a.trace_answer_format, a.observation_loss_coef) == (
        "outcome", TurnCreditParams().trace_weight, DEFAULT_ANSWER_FORMAT, 0.0)


def test_config_built_in_python_raises_config_error_naming_the_key():
    """nearpolicy.Config(...) (the Python API) says what load_config says, not pydantic's ValidationError."""
    from nearpolicy import Config as PublicConfig

    with pytest.raises(ConfigError, match=r"^invalid config: unknown key 'run\.stepz' \(did you mean 'run\.steps'\?\)$"):
        PublicConfig(run={"name": "x", "stepz": 3})
    with pytest.raises(ConfigError, match=r"'algorithm\.lr': Input should be greater than 0 \(got -1\)"):
        PublicConfig(algorithm={"lr": -1})
    assert PublicConfig(run={"name": "ok", "steps": 3}).run.steps == 3


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "mc_grpo", "mc_grpo_mad", "mc_grpo_released"])
def test_a_group_of_one_is_refused_for_group_relative_estimators(estimator):
    """TRL #3199 / #7060: with group_size = 1 every group-relative advantage is 0 and the run trains on nothing."""
    with pytest.raises(ConfigError, match=rf"algorithm\.group_size = 1 with algorithm\.advantage = '{estimator}'"):
        load_config(None, ["algorithm.group_size=1", f"algorithm.advantage={estimator}"])
    assert load_config(None, ["algorithm.group_size=2", f"algorithm.advantage={estimator}"]).algorithm.group_size == 2


def test_a_group_of_one_is_accepted_where_something_else_gives_the_signal():
    assert load_config(None, ["algorithm.group_size=1", "algorithm.advantage=reinforce"]).algorithm.group_size == 1
    pure = load_config(None, ["algorithm.group_size=1", "distill.teacher=smollm2"])  # distillation alone
    assert pure.algorithm.group_size == 1
    with pytest.raises(ConfigError, match="algorithm.group_size = 1"):  # the task's part would be 0
        load_config(None, ["algorithm.group_size=1", "distill.teacher=smollm2", "distill.reward_weight=0.5"])


@pytest.mark.parametrize("example, message", [
    ([{"role": "assistant", "content": "Answer: 1"}], r"task.example\[0\] is assistant"),
    ([{"role": "user", "content": "1 + 1 ="}], "must end with an assistant turn"),
    ([{"role": "user", "content": "1 + 1 ="}, {"role": "user", "content": "2 + 2 ="}], r"task.example\[1\] is user"),
    ([{"role": "user", "content": " "}, {"role": "assistant", "content": "Answer: 2"}], r"task.example\[0\] has empty"),
    ([{"role": "tool", "content": "2"}], r"task.example\[0\] must be \{role, content\}"),
])
def test_task_examples_must_be_alternating_worked_turns(example, message, tmp_path):
    items = ", ".join(f'{{role = "{m["role"]}", content = "{m["content"]}"}}' for m in example)
    path = tmp_path / "config.toml"
    path.write_text(f"[task]\nexample = [{items}]\n")
    with pytest.raises(ConfigError, match=message):
        load_config(path)
    path.write_text('[task]\nexample = [{role = "user", content = "1 + 1 ="}, {role = "assistant", content = "2"}]\n')
    assert [m["role"] for m in load_config(path).task.example] == ["user", "assistant"]


def test_a_runs_config_json_loads_as_a_config_with_set_layers_on_top(tmp_path):
    import json

    saved = load_config(None, ["run.steps=7", "algorithm.lr_schedule=cosine", "correction.preset=icepop"])
    path = tmp_path / "config.json"
    path.write_text(json.dumps(saved.model_dump(mode="json")))
    assert load_config(path) == saved  # the whole config round-trips, preset fields included
    again = load_config(path, ["run.name=NEW", "model.path=/m"])
    assert (again.run.name, again.model.path, again.run.steps, again.correction.preset) == ("NEW", "/m", 7, "icepop")
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"config\.json: a config must be a JSON object, not list"):
        load_config(path)
    path.write_text('{"run": {"steps": 5}, "run": {"name": "x"}}')  # TOML refuses a repeated table too
    with pytest.raises(ConfigError, match=r"config\.json: key 'run' appears twice"):
        load_config(path)
    path.write_text("{")
    with pytest.raises(ConfigError, match=r"config\.json: not valid JSON"):
        load_config(path)
    with pytest.raises(ConfigError, match="config file not found: .*nope.json"):
        load_config(tmp_path / "nope.json")
