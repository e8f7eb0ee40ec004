"""Stochastic rounding at export (engines/gguf/rounding.py): unbiased, on nearest rounding's grid, a pure function of
seed and weights, and exactly the weights the precision-aligned trainer uses."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from nearpolicy.model.aligned import align_model, engine_weight
from nearpolicy.config.schema import ConfigError, config_from_data
from nearpolicy.engines.gguf.rounding import check_rounding, dither
from nearpolicy.engines.gguf.export import _permute, export_gguf
from nearpolicy.types import SamplingParams

Q = gguf.GGMLQuantizationType
TYPES = {"q8_0": Q.Q8_0, "q4_1": Q.Q4_1}


def _roundtrip(w: np.ndarray, precision: str) -> np.ndarray:
    qtype = TYPES[precision]
    return gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype).reshape(w.shape)


def _on_grid_plus_offsets(precision: str, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(grid weights g, g + f * step with f ~ U[-0.3, 0.3] off the block extremes, f): training's small updates of
    weights that start on the engine's grid, as the shipped GGUF's dequantized weights do."""
    grid = _roundtrip(rng.standard_normal((32, 256)).astype(np.float32) * 0.02, precision)
    blocks = grid.reshape(-1, 32)
    if precision == "q8_0":
        top = np.abs(blocks).max(1, keepdims=True)
        step, extreme = top / 127, np.abs(blocks) == top
    else:
        lo, hi = blocks.min(1, keepdims=True), blocks.max(1, keepdims=True)
        step, extreme = (hi - lo) / 15, (blocks == lo) | (blocks == hi)
    f = np.where(extreme, 0, rng.uniform(-0.3, 0.3, blocks.shape)).astype(np.float32)
    return grid, (blocks + f * step).reshape(grid.shape), f.reshape(grid.shape)


@pytest.mark.parametrize("precision", sorted(TYPES))
def test_stochastic_rounding_keeps_small_updates_in_expectation(precision) -> None:
    """Nearest rounding sends every sub-half-step update back to its grid point (update erasure); stochastic
    rounding moves a weight with probability |f| and its mean over draws is the master weight."""
    grid, master, f = _on_grid_plus_offsets(precision, np.random.default_rng(0))
    assert np.array_equal(_roundtrip(master, precision), grid)  # nearest: all erased
    draws = np.stack([_roundtrip(dither(master, precision, seed), precision) for seed in range(300)])
    moved = draws != grid
    inner = f != 0
    assert abs(moved[:, inner].mean() - np.abs(f[inner]).mean()) < 0.01, (moved[:, inner].mean(), np.abs(f).mean())
    step = np.abs(master - grid)[inner] / np.abs(f[inner])
    bias = (draws.mean(0) - master)[inner] / step  # in grid steps; sampling sd about 0.45 / sqrt(300) per weight
    assert abs(bias.mean()) < 0.005 and np.abs(bias).mean() < 0.03, (bias.mean(), np.abs(bias).mean())
    assert np.array_equal(draws[:, ~inner], np.broadcast_to(grid[~inner], draws[:, ~inner].shape))


@pytest.mark.parametrize("precision", sorted(TYPES))
def test_dither_rounds_onto_nearest_roundings_grid(precision) -> None:
    """Each block keeps the scale d (and q4_1's minimum m) nearest rounding stores; every weight lands on one of
    the two grid points around it."""
    w = np.random.default_rng(1).standard_normal((16, 128)).astype(np.float32)
    head = 2 if precision == "q8_0" else 4  # fp16 d, (q4_1) fp16 m
    near = gguf.quants.quantize(w, TYPES[precision]).reshape(-1, head + (32 if precision == "q8_0" else 16))
    sr = gguf.quants.quantize(dither(w, precision, 7), TYPES[precision]).reshape(near.shape)
    assert np.array_equal(near[:, :head], sr[:, :head])
    out, nearest = _roundtrip(dither(w, precision, 7), precision), _roundtrip(w, precision)
    assert (out != nearest).mean() > 0.2  # stochastic rounding did round differently
    blocks = w.reshape(-1, 32)
    step = (np.abs(blocks).max(1, keepdims=True) / 127 if precision == "q8_0"
            else (blocks.max(1, keepdims=True) - blocks.min(1, keepdims=True)) / 15)
    assert (np.abs(out - w).reshape(-1, 32) <= step * 1.001).all()  # never further than one step


def test_dither_is_a_function_of_seed_and_weights() -> None:
    w = np.random.default_rng(2).standard_normal((4, 64)).astype(np.float32)
    assert np.array_equal(dither(w, "q4_1", 3), dither(w.copy(), "q4_1", 3))
    assert not np.array_equal(dither(w, "q4_1", 3), dither(w, "q4_1", 4))
    w2 = w.copy()
    w2[0, 0] += 1e-6
    assert not np.array_equal(dither(w, "q4_1", 3)[1:], dither(w2, "q4_1", 3)[1:])  # a changed weight: a new draw
    assert np.array_equal(dither(w, "f16", 3), w)


def test_stochastic_rounding_refuses_what_it_does_not_cover() -> None:
    with pytest.raises(ValueError, match="covers q8_0, q4_1.*q4_0"):
        check_rounding("stochastic", {"q4_1", "q4_0"})
    with pytest.raises(ValueError, match="unknown export rounding 'floor'"):
        check_rounding("floor", {"q4_1"})
    with pytest.raises(ValueError, match="whole 32-value blocks"):
        dither(np.zeros((2, 48), np.float32), "q8_0", 0)
    with pytest.raises(ConfigError, match="engine.export_rounding.*mxfp4"):
        config_from_data({"engine": {"precision": "q4_1", "export_rounding": "stochastic",
                                     "tensor_precision": {"mlp": "mxfp4"}}})
    with pytest.raises(ConfigError, match="engine.export_rounding = 'stochastic'.*engine.kind = 'hf' loads no GGUF"):
        config_from_data({"engine": {"kind": "hf", "export_rounding": "stochastic"}})
    assert config_from_data({"engine": {"precision": "q4_1", "export_rounding": "stochastic",
                                        "tensor_precision": {"embeddings": "q8_0", "blk.0": "f16"}}})


@pytest.mark.parametrize("precision", sorted(TYPES))
def test_stochastic_export_is_what_the_aligned_forward_uses(precision, tiny_model_dir, smollm2_gguf, tmp_path) -> None:
    """The GGUF the engine loads and the aligned trainer's weights come from the same draw, bit for bit, including
    the q / k rows the exporter permutes after rounding."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    out = tmp_path / "sr.gguf"
    export_gguf(model.state_dict(), model.config, out, precision, smollm2_gguf, rounding="stochastic", rounding_seed=5)
    tensors = {t.name: t for t in gguf.GGUFReader(out).tensors}
    layer = model.model.layers[1]
    for name, weight, heads in (("blk.1.ffn_down.weight", layer.mlp.down_proj.weight, None),
                                ("blk.1.attn_k.weight", layer.self_attn.k_proj.weight, model.config.num_key_value_heads)):
        t = tensors[name]
        stored = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(weight.shape)
        aligned = engine_weight(weight.detach(), precision, "stochastic", 5)[0].numpy()
        assert np.array_equal(stored, aligned if heads is None else _permute(aligned, heads)), name
        assert not np.array_equal(aligned, engine_weight(weight.detach(), precision)[0].numpy())


def _teacher_forced(model, prompt: list[int], completion: list[int]) -> np.ndarray:
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([prompt + completion])).logits[0].float(), -1)
    return lp[torch.arange(len(prompt) - 1, len(prompt) + len(completion) - 1), torch.tensor(completion)].numpy()


def test_aligned_forward_with_stochastic_rounding_matches_the_engine(tiny_model_dir, smollm2_gguf, tmp_path) -> None:
    """The aligned trainer on a stochastic-rounding export is as close to llama.cpp as on a nearest one
    (test_aligned.ENGINE_BOUNDS["q4_1"]: mean 0.03, max 0.1 nats) and much closer than the plain trainer."""
    from transformers import AutoModelForCausalLM

    from nearpolicy.engines.llamacpp import LlamaCppEngine

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    out = tmp_path / "sr-q4_1.gguf"
    export_gguf(model.state_dict(), model.config, out, "q4_1", smollm2_gguf, rounding="stochastic", rounding_seed=9)
    g = torch.Generator().manual_seed(1)
    prompt, completion = torch.randint(3, 49152, (20,), generator=g).tolist(), torch.randint(3, 49152, (40,), generator=g).tolist()
    engine = LlamaCppEngine(out, max_context=128, max_parallel_sequences=1, threads=1, adaptive_threads=False)
    try:
        mu = np.array(engine.score(prompt, completion, SamplingParams()))
    finally:
        engine.close()
    plain = np.abs(_teacher_forced(model, prompt, completion) - mu)
    with align_model(model, "q4_1", rounding="stochastic", seed=9):
        aligned = np.abs(_teacher_forced(model, prompt, completion) - mu)
    with align_model(model, "q4_1", rounding="stochastic", seed=10):  # another draw: not the engine's weights
        other = np.abs(_teacher_forced(model, prompt, completion) - mu)
    mean_bound, max_bound = 0.03, 0.1  # test_aligned.ENGINE_BOUNDS["q4_1"]
    assert aligned.mean() < mean_bound and aligned.max() < max_bound, (aligned.mean(), aligned.max())
    assert aligned.mean() * 4 < plain.mean() and aligned.mean() * 2 < other.mean(), (aligned.mean(), other.mean())


def test_erasure_bench_measures_a_q4_0_run_without_stochastic_rows(tiny_model_dir, tmp_path) -> None:
    """bench/erasure.py on a run whose engine type stochastic rounding does not cover (q4_0): the nearest rows only
    (it raised ValueError), with the right numbers for an update it can predict (every weight x3)."""
    import json
    import sys
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    import erasure

    cfg = config_from_data({"model": {"path": str(tiny_model_dir)}, "engine": {"precision": "q4_0"}})
    run = tmp_path / "run"
    (run / "checkpoints" / "step_000001").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(cfg.model_dump(mode="json")))
    weights = load_file(str(tiny_model_dir / "model.safetensors"))
    save_file({k: (v * 3 if v.ndim == 2 else v).contiguous() for k, v in weights.items()},
              str(run / "checkpoints" / "step_000001" / "model.safetensors"))
    rows = erasure.measure(run)
    assert [(r["rounding"], r["type"], r["rounding_used_by_run"]) for r in rows] == [("nearest", "q4_0", True)]
    # x3 scales each block's d by 3 and keeps its q: only the weights whose q4_0 value is 0 keep their engine value
    zero = np.concatenate([_roundtrip_q4_0(v.numpy()).ravel() == 0 for v in weights.values() if v.ndim == 2])
    assert rows[0]["moved"] > 0.999 and rows[0]["erased"] == pytest.approx(zero.mean(), abs=1e-4)
    assert abs(rows[0]["reach"] - 1) < 0.05 and rows[0]["cosine"] > 0.98, rows[0]


def _roundtrip_q4_0(w: np.ndarray) -> np.ndarray:
    return gguf.quants.dequantize(gguf.quants.quantize(w, Q.Q4_0), Q.Q4_0).reshape(w.shape)


def test_nearpolicy_export_writes_the_runs_own_stochastic_draw(tiny_model_dir, tmp_path) -> None:
    """`nearpolicy export` at the run's engine.precision writes the file the run's engine loaded: the stochastic draw
    of engine.export_rounding seeded by run.seed (it wrote nearest rounding); other precisions stay nearest."""
    import json
    import shutil

    from nearpolicy.runs.export import export_run

    cfg = config_from_data({"model": {"path": str(tiny_model_dir)}, "run": {"seed": 7},
                            "engine": {"precision": "q8_0", "export_rounding": "stochastic"}})
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(cfg.model_dump(mode="json")))
    (run / "plan.json").write_text(json.dumps({"stop_token_ids": [2]}))
    shutil.copytree(tiny_model_dir, run / "checkpoints" / "step_000001")
    done = export_run(run, ggufs=("q8_0", "q4_1"), log=lambda _: None)
    from safetensors.torch import load_file

    weight = load_file(str(tiny_model_dir / "model.safetensors"))["model.layers.0.mlp.down_proj.weight"]
    for precision, rounding in (("q8_0", "stochastic"), ("q4_1", "nearest")):
        t = next(t for t in gguf.GGUFReader(done.folder / f"policy-{precision}.gguf").tensors
                 if t.name == "blk.0.ffn_down.weight")
        stored = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(weight.shape)
        assert np.array_equal(stored, engine_weight(weight, precision, rounding, 7)[0].numpy()), precision
    assert not np.array_equal(engine_weight(weight, "q8_0", "stochastic", 7)[0], engine_weight(weight, "q8_0")[0])


def test_align_model_refuses_a_rounding_it_cannot_apply_before_the_first_forward(tiny_model_dir) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    with pytest.raises(ValueError, match="covers q8_0, q4_1.*q4_0"):
        align_model(model, "q4_0", rounding="stochastic")
    with pytest.raises(ValueError, match="unknown export rounding 'floor'"):
        align_model(model, "q8_0", rounding="floor")
    assert getattr(model, "_nearpolicy_alignment", None) is None  # nothing patched: a plain forward
    with align_model(model, "q4_1", (("embeddings", "q8_0"),), rounding="stochastic"):
        pass
