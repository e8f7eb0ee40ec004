"""`nearpolicy gradbias` end to end on the tiny model (slow), and its refusals (fast)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from nearpolicy.cli import main
from nearpolicy.gradbias.run import GradbiasSettings, run_gradbias


@pytest.mark.parametrize("args,message", [
    (["--sources", "q9_9"], "unknown source 'q9_9'"),
    (["--sources", "noise-1"], "noise<std> with std > 0"),
    (["--sources", "stale", "--warmup", "0"], "the stale source needs --warmup >= 1"),
    (["--corrections", "tis", "off"], "the first correction must be 'off'"),
    (["--corrections", "off", "nope"], "unknown correction 'nope'"),
    (["--replicates", "2"], "--replicates must be >= 3"),
    (["--sketch-dim", "-5"], "--sketch-dim must be >= 1"),
    (["--set", "algorithm.trainer_precision=bf16"], "gradbias measures the fp32 trainer's gradients"),
])
def test_bad_settings_are_refused_before_anything_loads(args, message, capsys, tmp_path):
    assert main(["gradbias", "--out", str(tmp_path / "g"), *args]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "g").exists()


def test_analyze_of_a_folder_without_a_measurement_says_so(capsys, tmp_path):
    assert main(["gradbias", "--analyze", str(tmp_path)]) == 2
    assert "grams.npz" in capsys.readouterr().err


@pytest.mark.slow
def test_a_measurement_runs_resumes_and_refuses_other_settings(tiny_model_dir, tmp_path):
    from test_api import _setup  # the tiny model on a JSONL task with a reward that varies within a group

    cfg = _setup(tmp_path, tiny_model_dir)
    sets = [f"{k}={json.dumps(v) if isinstance(v, str) else v}" for k, v in {
        "model.path": str(tiny_model_dir), "run.threads": 1, "engine.kind": "hf", "algorithm.prompts_per_step": 2,
        "algorithm.group_size": 4, "algorithm.micro_batch_size": 4, "sampling.max_new_tokens": 6,
        "model.max_context": 256, "task.kind": "jsonl", "task.path": str(cfg.task.path), "task.eval_size": 4,
        "task.reward_function": cfg.task.reward_function, "logging.tensorboard": "false",
        "logging.progress": "false"}.items()]
    sets = [s.replace('"false"', "false") for s in sets]
    out = tmp_path / "gradbias"
    settings = GradbiasSettings(out, ("f32", "q8_0", "stale"), ("off", "tis", "seq_tis"), replicates=3, warmup=1,
                                sketch_dim=4096, progress=False)
    table = run_gradbias(None, sets, settings, log=lambda m: None)
    assert set(table["sources"]) == {"f32", "q8_0", "stale"}
    assert set(table["sources"]["q8_0"]["corrections"]) == {"off", "tis", "seq_tis"}
    assert table["meta"]["trainer_version"] == 1 and table["meta"]["replicates"] == 3
    for name in ("gradbias.json", "gradbias.md", "gradbias.png", "gradbias.html", "grams.npz", "effects.json"):
        assert (out / name).stat().st_size > 0
    stored = {p.name: p.stat().st_mtime_ns for p in (out / "replicates").iterdir()}
    assert len(stored) == 3 * 4  # reference + 3 sources, 3 replicates
    again = run_gradbias(None, sets, settings, log=lambda m: None)  # resumed: nothing sampled again
    assert {p.name: p.stat().st_mtime_ns for p in (out / "replicates").iterdir()} == stored
    assert again["sources"]["q8_0"]["facts"]["k3"] == table["sources"]["q8_0"]["facts"]["k3"]
    other = GradbiasSettings(out, ("f32",), ("off",), replicates=3, warmup=1, sketch_dim=4096, progress=False)
    with pytest.raises(ValueError, match="other settings"):
        run_gradbias(None, sets, other, log=lambda m: None)
    with pytest.raises(ValueError, match="other settings"):  # the same names on another config: refused too
        run_gradbias(None, [*sets, "algorithm.group_size=2"], settings, log=lambda m: None)


def test_analyze_of_a_corrupted_measurement_names_the_file(capsys, tmp_path):
    """A truncated grams.npz, invalid effects.json or a source without its Gram matrix is a clear error (exit 2),
    not a traceback."""
    import numpy as np

    np.savez(tmp_path / "grams.npz", corrections=np.array(["off"]), replicates=np.array(3), q8=np.eye(6))
    effects = {"meta": {"sources": {}}, "reference": [], "sources": {"q8": {}, "q4": {}}}
    (tmp_path / "effects.json").write_text(json.dumps(effects))
    assert main(["gradbias", "--analyze", str(tmp_path)]) == 2
    assert "grams.npz: has no q4 (effects.json lists them)" in capsys.readouterr().err
    (tmp_path / "effects.json").write_text("{not json")
    assert main(["gradbias", "--analyze", str(tmp_path)]) == 2
    assert "effects.json is not valid JSON" in capsys.readouterr().err
    (tmp_path / "grams.npz").write_bytes((tmp_path / "grams.npz").read_bytes()[:40])
    assert main(["gradbias", "--analyze", str(tmp_path)]) == 2
    assert "grams.npz is unreadable" in capsys.readouterr().err


@pytest.mark.parametrize("change, message", [
    (lambda g, e: g.update(replicates=np.array(5)), "grams.npz: f32's Gram matrix is (110, 110), not (55, 55)"),
    (lambda g, e: g.update(corrections=g["corrections"][1:]), "corrections must be a list of names including 'off'"),
    (lambda g, e: g.update(replicates=np.array([3, 4])), "replicates must be one integer >= 2"),
    (lambda g, e: g.update(q8_0=np.ones(110)), "q8_0's Gram matrix is (110,)"),
    (lambda g, e: e.update(sources=list(e["sources"])), "non-empty sources object"),
    (lambda g, e: e["sources"]["q8_0"].pop("effects"), "source q8_0 needs a non-empty facts list"),
    (lambda g, e: e["sources"]["q8_0"].update(facts=[]), "source q8_0 needs a non-empty facts list"),
    (lambda g, e: e.update(meta={}), "needs an object with meta"),
    (lambda g, e: e.update(reference="x"), "needs an object with meta"),
])
def test_analyze_refuses_an_inconsistent_measurement_instead_of_a_wrong_table(change, message, capsys, tmp_path):
    """Review finding: a replicate count or correction list that does not match the Gram matrices gave exit 0 and a
    table from the wrong blocks, and other inconsistencies tracebacks. The committed measurement, changed in one
    field, is refused (exit 2) naming the file and the fault."""
    import shutil
    from pathlib import Path

    import numpy as np

    committed = Path(__file__).resolve().parent.parent / "docs" / "gradbias"
    grams = dict(np.load(committed / "grams.npz"))
    effects = json.loads((committed / "effects.json").read_text())
    change(grams, effects)
    np.savez(tmp_path / "grams.npz", **grams)
    (tmp_path / "effects.json").write_text(json.dumps(effects))
    assert main(["gradbias", "--analyze", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err
    shutil.copy(committed / "grams.npz", tmp_path / "grams.npz")
    shutil.copy(committed / "effects.json", tmp_path / "effects.json")
    assert main(["gradbias", "--analyze", str(tmp_path)]) == 0  # the committed files themselves pass
