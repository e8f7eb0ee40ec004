"""`nearpolicy diagnose` on the tiny model: the f32 engine is admitted with KL near zero, an engine with perturbed
weights is rejected, the sensitivity scan ranks a damaged block first, the budget and recipe math, the CLI."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nearpolicy.config.schema import load_config
from nearpolicy.diagnosis import measure
from nearpolicy.diagnosis.admission import admitted, bits_per_weight, make_budget, propose_recipe, verdict_line
from nearpolicy.diagnosis.candidates import parse_candidate
from nearpolicy.diagnosis.run import DiagnoseSettings, run_diagnosis
from nearpolicy.diagnosis.sensitivity import UnitSensitivity


def _cfg(model_dir: Path, *extra: str):
    return load_config(None, [f"model.path='{model_dir}'", "sampling.max_new_tokens=8", "logging.progress=false",
                              "task.train_size=50", "task.eval_size=4", *extra])


@pytest.mark.slow  # over 10 s on 2 cores
def test_f32_admitted_near_zero_and_perturbed_engine_rejected(tiny_model_dir, tmp_path, monkeypatch):
    real = measure.engine_state_dict

    def perturbed(ctx, candidate):  # the "f16" candidate gets weights with 5% relative noise
        state = real(ctx, candidate)
        if candidate.precision != "f16":
            return state
        g = torch.Generator().manual_seed(1)
        return {k: v + 0.05 * v.std() * torch.randn(v.shape, generator=g) if v.ndim >= 2 else v for k, v in state.items()}

    monkeypatch.setattr(measure, "engine_state_dict", perturbed)
    (tmp_path / "diag" / "engine").mkdir(parents=True)
    (tmp_path / "diag" / "engine" / "notes.txt").write_text("the user's")  # diagnose must not touch it
    settings = DiagnoseSettings(candidates=["llamacpp:f32,kv_cache=f32", "llamacpp:f16"], prompts=3, group_size=2,
                                out=tmp_path / "diag", progress=False)
    report, code = run_diagnosis(_cfg(tiny_model_dir), settings, log=lambda msg: None)
    f32, noisy = report["candidates"]
    assert f32["k3"] < 1e-9 and f32["abs_logprob_diff_max"] < 5e-5 and f32["ess"] > 0.999999 and f32["admitted"]
    assert abs(f32["seq_log_ppl_diff"]) < 5e-6  # the per-sequence family too
    assert f32["seq_training_ppl"] == pytest.approx(f32["seq_rollout_ppl"], rel=1e-5)
    assert report["budget"]["k3"] == pytest.approx(math.log(2) / 16)  # default rule at 8 new tokens
    assert noisy["k3"] > report["budget"]["k3"] and not noisy["admitted"]
    # the aligned column: nothing to align at f32 with an f32 KV cache; the f16-weight trainer stays far off the noise
    assert f32["aligned_k3"] == pytest.approx(f32["k3"], abs=1e-9) and noisy["aligned_k3"] > report["budget"]["k3"]
    assert code == 1 and not report["all_admitted"]
    assert report["floor"]["k3"] < 1e-9
    rows = (tmp_path / "diag" / "diagnose.csv").read_text().splitlines()
    assert len(rows) == 4 and rows[0].startswith("candidate,weights,k1,k3") and rows[3].endswith("False")
    assert (tmp_path / "diag" / "position.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((tmp_path / "diag" / "diagnose.json").read_text())["candidates"][0]["admitted"] is True
    assert (tmp_path / "diag" / "engine" / "notes.txt").read_text() == "the user's"
    assert not list((tmp_path / "diag").glob(".diagnose-engine-*"))  # its own scratch folder is gone


@pytest.fixture(scope="module")
def damaged_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with a damaged block 1: one outlier (20, against weights of std 0.02) per 32-weight block of
    its q/k/v/gate/up projections, in input dimensions that its RMSNorm weights zero. The trainer's function
    ignores the outliers, but q8_0's per-block scale then rounds every other weight of the block to 0."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    layer = model.model.layers[1]
    with torch.no_grad():
        layer.input_layernorm.weight[::32] = 0.0
        layer.post_attention_layernorm.weight[::32] = 0.0
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.mlp.gate_proj,
                     layer.mlp.up_proj):
            proj.weight[:, ::32] = 20.0
    folder = tmp_path_factory.mktemp("damaged")
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(str(tiny_model_dir)).save_pretrained(folder)
    return folder


@pytest.mark.slow  # over 10 s on 2 cores
def test_sensitivity_scan_ranks_the_damaged_block_first(damaged_model_dir, tmp_path):
    settings = DiagnoseSettings(candidates=["llamacpp:f32"], prompts=2, group_size=2, out=tmp_path / "scan",
                                sensitivity=["q8_0"], progress=False)
    report, _ = run_diagnosis(_cfg(damaged_model_dir), settings, log=lambda msg: None)
    units = report["sensitivity"]["q8_0"]["units"]
    assert units[0]["unit"] == "blk.1"  # first of all units, tensor kinds included
    blocks = [u for u in units if u["kind"] == "block"]
    assert [u["unit"] for u in blocks] == ["blk.1", "blk.0"]
    assert blocks[0]["added_k3"] > 10 * max(blocks[1]["added_k3"], 1e-9)
    assert {u["unit"] for u in units} == {"embeddings", "attention", "mlp", "blk.0", "blk.1"}  # output tied
    assert (tmp_path / "scan" / "sensitivity-q8_0.png").read_bytes()[:4] == b"\x89PNG"
    csv_rows = (tmp_path / "scan" / "sensitivity-q8_0.csv").read_text().splitlines()
    assert csv_rows[0] == "unit,kind,k3,added_k3,parameters" and len(csv_rows) == 6


def test_default_budget_rule_and_alternatives():
    b = make_budget(1e-6, 64)
    assert b.k3 == pytest.approx(math.log(2) / 128)
    assert math.exp(-2 * 64 * b.k3) == pytest.approx(0.5)  # the sequence-ESS model the rule inverts
    assert make_budget(1e-6, 64, absolute=1e-3).k3 == 1e-3
    assert make_budget(2e-6, 64, floor_multiple=10).k3 == pytest.approx(2e-5)
    assert admitted(1e-3, make_budget(0, 1, absolute=1e-3)) and not admitted(float("nan"), b)
    for kwargs in ({"absolute": 1e-3, "floor_multiple": 10}, {"absolute": 0.0}, {"floor_multiple": 0.5},
                   {"seq_ess_min": 1.0}):
        with pytest.raises(ValueError):
            make_budget(1e-6, 64, **kwargs)


def test_verdict_lines_explain_each_verdict_by_the_budget_it_met_or_failed():
    ess_rule = make_budget(1e-10, 64)  # k3 <= ln 2 / 128 = 0.00542
    k3 = math.log(5) / 128  # sequence ESS exp(-128 k3) = 0.2
    assert verdict_line("llamacpp:q4_1", k3, ess_rule) == ("llamacpp:q4_1 rejected: sequence ESS at 64 tokens 0.2 < 0.5 "
                                                          "(exp(-2 x 64 x k3), k3 0.0126 > 0.00542)")
    assert verdict_line("llamacpp:f16", math.log(1 / 0.9) / 128, ess_rule) == (
        "llamacpp:f16 admitted: sequence ESS at 64 tokens 0.9 >= 0.5 (exp(-2 x 64 x k3), k3 0.000823 <= 0.00542)")
    assert verdict_line("hf:bf16", 3e-3, make_budget(1e-4, 64, floor_multiple=10)) == (
        "hf:bf16 rejected: k3 0.003 is 30 x the noise floor 0.0001 (> 10 x, the budget 0.001)")
    assert verdict_line("hf:bf16", 3e-3, make_budget(1e-4, 64, absolute=5e-3)) == (
        "hf:bf16 admitted: k3 0.003 <= the budget 0.005")
    assert verdict_line("x", float("nan"), ess_rule) == "x rejected: k3 is nan (not finite)"


def _report(budget, *candidates):
    """A diagnose report as run_diagnosis returns it: (name, k3, admitted) per candidate."""
    from dataclasses import asdict

    def row(name, k3, ok):
        return {"candidate": name, "weights": "w", "k1": k3, "k3": k3, "k3_se": 1e-9, "chi2": 2 * k3, "ess": 0.99,
                "seq_ess": 0.5, "abs_logprob_diff_p99": 0.1, "abs_logprob_diff_max": 0.2,
                "frac_ratio_outside_0.5_2": 0.0, "admitted": ok, "seq_training_ppl": 1.5, "seq_rollout_ppl": 1.4,
                "seq_log_ppl_diff": 4 * k3, "seq_log_ppl_abs_diff": 5 * k3, "seq_log_ppl_diff_min": -k3,
                "seq_log_ppl_diff_max": 9 * k3, "seq_ppl_ratio": 1.07, "seq_chi2": 0.3, "seq_empty_count": 0.0}

    return {"budget": asdict(budget), "floor": row("floor: llamacpp:f32,kv_cache=f32", 1e-10, None),
            "candidates": [row(*c) for c in candidates], "recipes": []}


def test_cli_writes_the_table_and_verdicts_to_stdout_and_logs_to_stderr(tmp_path, monkeypatch, capsys):
    from nearpolicy.cli import main
    from nearpolicy.diagnosis import run as run_module

    report = _report(make_budget(1e-10, 64), ("llamacpp:f16", 1e-4, True), ("llamacpp:q4_1", math.log(5) / 128, False))

    def fake(cfg, settings, log):
        log("measuring (a log line)")
        return report, 1

    monkeypatch.setattr(run_module, "run_diagnosis", fake)
    assert main(["diagnose", "--out", str(tmp_path / "d"), "--set", "logging.progress=false"]) == 1
    out, err = capsys.readouterr()
    assert out.startswith("budget: sequence ESS >= 0.5 at 64 tokens") and "| llamacpp:q4_1 | w | 0.0126" in out
    assert "- llamacpp:q4_1 rejected: sequence ESS at 64 tokens 0.2 < 0.5 (exp(-2 x 64 x k3)" in out
    assert "- llamacpp:f16 admitted: sequence ESS at 64 tokens 0.987 >= 0.5" in out
    assert "| llamacpp:q4_1 | 1.5 | 1.4 | 0.0503 | 0.0629 | -0.0126 / 0.113 | 1.07 | 0.3 | 0 |" in out  # per sequence
    assert out.endswith("\n1 of 2 candidate(s) rejected\n")
    assert err == f"measuring (a log line)\nwrote {tmp_path / 'd' / 'diagnose.json'}, .csv and position.png\n"


def test_recipe_promotes_by_k3_per_byte_until_the_prediction_fits():
    assert bits_per_weight("q4_1") == 5.0 and bits_per_weight("q8_0") == 8.5 and bits_per_weight("f16") == 16.0
    units = [UnitSensitivity("blk.0", "block", 0, 0.006, 100), UnitSensitivity("blk.1", "block", 0, 0.003, 100),
             UnitSensitivity("embeddings", "tensor kind", 0, 0.001, 1000),
             UnitSensitivity("mlp", "tensor kind", 0, 0.009, 150)]  # a kind: never promoted (overlaps blocks)
    # excess 0.01 attributed 6 : 3 : 1; target 0.005 -> promote blk.0 (predicted 0.01 - 0.006 = 0.004)
    r = propose_recipe("q4_1", 0.0, 0.01, units, 0.005)
    assert r.promoted == ("blk.0",) and r.predicted_k3 == pytest.approx(0.004)
    assert r.extra_bytes == pytest.approx(100 * 11 / 8) and r.overrides == (("blk.0", "f16"),)
    r2 = propose_recipe("q4_1", 0.0, 0.01, units, 0.005, skip=1)
    assert r2.promoted == ("blk.0", "blk.1") and r2.predicted_k3 == pytest.approx(0.001)
    everything = propose_recipe("q4_1", 0.0, 0.01, units, 1e-12)
    assert everything.predicted_k3 == pytest.approx(0.0, abs=1e-15) and len(everything.promoted) == 3
    assert propose_recipe("q4_1", 0.002, 0.01, units, 0.001) is None  # below the reference: unreachable


def test_candidate_strings_round_trip_and_errors():
    c = parse_candidate("llamacpp:q4_1,blk.0-2=f16,kv_cache=f32,temperature=0.7,weights_only=true")
    assert c.tensor_precision == (("blk.0-2", "f16"),) and c.kv_cache == "f32" and c.weights_only
    assert parse_candidate(c.spec()) == c and c.sampling == {"temperature": 0.7}
    assert c.weights_description() == "q4_1 (blk.0-2=f16) rounded, f32 kernels"
    v = parse_candidate("vllm:bf16,top_k=20")
    assert (v.engine, v.precision, v.sampling, parse_candidate(v.spec())) == ("vllm", "bf16", {"top_k": 20}, v)
    for bad, words in [("sglang:fp32", "llamacpp:<precision>"), ("vllm:f16", "unknown vllm precision 'f16'; valid: fp32, bf16"),
                       ("vllm:fp32,kv_cache=f32", "cannot use option"), ("llamacpp:q2_k", "unknown llamacpp precision"),
                       ("llamacpp:q4_1,blk.x=f16", "selector"), ("hf:bf16,blk.0=f16", "cannot use option"), ("hf:bf16,kv_cache=f32", "cannot use option"),
                       ("hf:fp32,flash_attention=true", "cannot use option"),
                       ("llamacpp:f16,top_p=2", "top_p"), ("llamacpp:f16,top_k=two", "top_k must be a int")]:
        with pytest.raises(ValueError, match=words):
            parse_candidate(bad)


@pytest.mark.slow
def test_cli_exit_codes_and_outputs(tiny_model_dir, tmp_path):
    base = [sys.executable, "-m", "nearpolicy", "diagnose", "--set", f"model.path='{tiny_model_dir}'", "--set",
            "sampling.max_new_tokens=6", "--set", "logging.progress=false", "--prompts", "2", "--group", "2"]
    bad = subprocess.run(base + ["--candidates", "llamacpp:q9"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "unknown llamacpp precision 'q9'" in bad.stderr
    ok = subprocess.run(base + ["--out", str(tmp_path / "ok"), "--candidates", "hf:fp32", "--budget-k3", "1e-6"],
                        capture_output=True, text=True, timeout=600)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "every candidate admitted" in ok.stdout and "| hf:fp32 | fp32 |" in ok.stdout  # the table: stdout
    assert "- hf:fp32 admitted: k3 " in ok.stdout and "| hf:fp32 |" not in ok.stderr
    assert "| candidate | trainer PPL | engine PPL | log-PPL diff d |" in ok.stdout
    report = json.loads((tmp_path / "ok" / "diagnose.json").read_text())
    assert report["budget"]["rule"].startswith("absolute") and report["candidates"][0]["k3"] < 1e-9


def test_weights_only_rounds_each_tensor_exactly_as_the_engine_stores_it(tiny_model_dir, smollm2_gguf, tmp_path):
    """weights_only=true hands the f32 engine the very values the quantized GGUF holds (here q4_1 blocks and q8_0
    embeddings, the shipped SmolLM2 recipe)."""
    import gguf

    from nearpolicy.diagnosis.measure import DiagnoseContext, engine_state_dict
    from nearpolicy.engines.gguf.export import export_gguf
    from nearpolicy.model.load import load_policy

    model, tokenizer = load_policy(str(tiny_model_dir))
    candidate = parse_candidate("llamacpp:q4_1,embeddings=q8_0,weights_only=true")
    ctx = DiagnoseContext(model, tokenizer, smollm2_gguf, [[1]], 1, None, tmp_path)
    rounded = engine_state_dict(ctx, candidate)
    out = tmp_path / "q.gguf"
    export_gguf(model.state_dict(), model.config, out, "q4_1", smollm2_gguf, tensor_precision=(("embeddings", "q8_0"),))
    stored = {t.name: t for t in gguf.GGUFReader(str(out)).tensors}
    for hf, name in (("model.layers.0.mlp.up_proj.weight", "blk.0.ffn_up.weight"),
                     ("model.embed_tokens.weight", "token_embd.weight")):
        t = stored[name]
        values = gguf.quants.dequantize(t.data, t.tensor_type).reshape(rounded[hf].shape)
        assert torch.equal(rounded[hf], torch.from_numpy(values.astype("float32")))
        assert not torch.equal(rounded[hf], model.state_dict()[hf])  # the rounding did something


def test_propose_scans_each_precision_once_and_keeps_the_admitted_recipe(tiny_model_dir, tmp_path, monkeypatch):
    """Two rejected q4_0 candidates share one sensitivity scan; the recipe search stops at the first admitted
    verification (measurements faked: k3 0.1 for plain candidates, 1e-4 once a block is promoted)."""
    from nearpolicy.diagnosis import run as run_module
    from nearpolicy.diagnosis.measure import CandidateResult

    scans = []

    def fake_scan(ctx, precision, reference, settings):
        scans.append(precision)
        units = [UnitSensitivity("blk.0", "block", 0.05, 0.05, 10), UnitSensitivity("blk.1", "block", 0.01, 0.01, 10)]
        return {"precision": precision, "reference": reference.spec(), "reference_k3": 0.0, "full_k3": 0.1,
                "units": [], "_units": units, "sequences": 1}

    def fake_measure(ctx, candidate, on_samples=lambda n: None):
        k3 = 1e-4 if candidate.tensor_precision or candidate.kv_cache == "f32" else 0.1
        metrics = {k: 0.0 for k in run_module.COLUMNS[2:]} | {"k3": k3}
        return CandidateResult(candidate.name, candidate.weights_description(), metrics, {})

    monkeypatch.setattr(run_module, "_scan", fake_scan)
    monkeypatch.setattr(run_module, "measure_candidate", fake_measure)
    settings = DiagnoseSettings(candidates=["llamacpp:q4_0", "llamacpp:q4_0,temperature=0.5"], prompts=1,
                                group_size=1, out=tmp_path / "p", propose=True, progress=False)
    report, code = run_diagnosis(_cfg(tiny_model_dir), settings, log=lambda msg: None)
    assert scans == ["q4_0"] and code == 1
    recipes = [r["recipe"] for r in report["recipes"]]
    assert [r["promoted"] for r in recipes] == [["blk.0"], ["blk.0"]]  # 0.1 - 0.1 * 5/6 <= 0.8 x budget
    assert recipes[1]["spec"] == "llamacpp:q4_0,blk.0=f16,temperature=0.5" and recipes[0]["admitted"]


def test_weights_of_another_shape_are_a_clear_error(tiny_model_dir, tmp_path):
    from safetensors.torch import save_file

    from nearpolicy.diagnosis.run import load_model_weights
    from nearpolicy.model.load import load_policy

    model, _ = load_policy(str(tiny_model_dir))
    weights = {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"][:10]
    save_file(weights, str(tmp_path / "wrong.safetensors"))
    with pytest.raises(ValueError, match="does not match the model"):
        load_model_weights(tmp_path / "wrong.safetensors", model)


def test_the_position_chart_of_candidates_without_a_positive_k3_draws_no_legend_and_no_warning(tmp_path):
    """An exact candidate (k3 0 at every position) draws no line; the chart is still written, without matplotlib's
    "No artists with labels found to put in legend" warning."""
    import warnings

    from nearpolicy.diagnosis.measure import CandidateResult
    from nearpolicy.diagnosis.plots import position_chart

    exact = CandidateResult("f32", "f32", {}, {"start": [0.0, 16.0], "k3": [0.0, 0.0]})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        path = position_chart([exact], tmp_path / "positions.png")
    assert path.read_bytes().startswith(b"\x89PNG")
