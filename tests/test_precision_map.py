"""Per-tensor precision maps: selectors, last-match-wins, the exported tensor types, weight rounding."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from nearpolicy.config.schema import ConfigError, load_config
from nearpolicy.engines.gguf.export import export_gguf
from nearpolicy.engines.gguf.export import round_to_precision
from nearpolicy.engines.gguf.precision_map import describe, precision_for, validate_selector


def test_selectors_and_last_match_wins():
    overrides = (("attention", "q8_0"), ("blk.1-2", "f16"), ("blk.2.ffn_down.weight", "f32"))
    assert precision_for("blk.0.attn_q.weight", "q4_1", overrides) == "q8_0"
    assert precision_for("blk.0.ffn_up.weight", "q4_1", overrides) == "q4_1"
    assert precision_for("blk.1.attn_q.weight", "q4_1", overrides) == "f16"  # the later block entry wins
    assert precision_for("blk.2.ffn_down.weight", "q4_1", overrides) == "f32"
    assert precision_for("blk.12.ffn_up.weight", "q4_1", (("blk.1", "f16"),)) == "q4_1"  # blk.1 is not blk.12
    assert precision_for("token_embd.weight", "q4_1", (("embeddings", "f16"),)) == "f16"
    assert precision_for("blk.4.ffn_up.weight", "q4_1", (("blk.3-4", "f16"),)) == "f16"
    assert precision_for("blk.5.ffn_up.weight", "q4_1", (("blk.3-4", "f16"),)) == "q4_1"
    assert precision_for("blk.7.ffn_up.weight", "q4_1", (("blk.0-99999999999", "f16"),)) == "f16"  # not expanded
    assert describe("q4_1", overrides[:1]) == "q4_1 (attention=q8_0)"


@pytest.mark.parametrize("bad", ["blocks", "blk.4-2", "attn", ""])
def test_unknown_selector_is_an_error_naming_it(bad):
    with pytest.raises(ValueError, match="selector|range"):
        validate_selector(bad)


def test_config_validates_tensor_precision():
    cfg = load_config(None, ['engine.tensor_precision={"blk.0-1" = "f16", embeddings = "q8_0"}'])
    assert list(cfg.engine.tensor_precision.items()) == [("blk.0-1", "f16"), ("embeddings", "q8_0")]
    with pytest.raises(ConfigError, match="tensor_precision"):
        load_config(None, ['engine.tensor_precision={"blk.zero" = "f16"}'])
    with pytest.raises(ConfigError, match="tensor_precision"):
        load_config(None, ['engine.tensor_precision={"blk.0" = "q2_k"}'])


def test_export_applies_the_map(tiny_model_dir: Path, smollm2_gguf: Path, tmp_path: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    out = tmp_path / "mixed.gguf"
    report = export_gguf(model.state_dict(), model.config, out, "q4_1", smollm2_gguf,
                         tensor_precision=(("blk.1", "f16"), ("embeddings", "q8_0")))
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(out)).tensors}
    assert types == report.tensor_types
    assert types["token_embd.weight"] == "Q8_0"
    assert types["blk.0.attn_q.weight"] == "Q4_1" and types["blk.1.attn_q.weight"] == "F16"
    assert types["blk.1.ffn_down.weight"] == "F16" and types["blk.1.attn_norm.weight"] == "F32"


def test_round_to_precision_is_idempotent_and_bounded():
    w = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    once = round_to_precision(w, "q4_1")
    assert np.array_equal(round_to_precision(once, "q4_1"), once)  # already on the grid
    step = (w.reshape(4, 2, 32).max(-1) - w.reshape(4, 2, 32).min(-1)) / 15  # q4_1: 16 levels per 32-block
    assert np.all(np.abs(once - w).reshape(4, 2, 32).max(-1) <= step * 0.5 + 1e-3)
    assert 0 < np.abs(once - w).max()
    odd = w[:, :40]
    assert np.array_equal(round_to_precision(odd, "q4_1"), odd)  # rows not a multiple of 32: unchanged


def test_a_selector_that_matches_no_tensor_is_refused(tiny_model_dir: Path, smollm2_gguf: Path, tmp_path: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    for selector in ("blk.7", "output"):  # 2 blocks; the output head is tied to the embeddings
        with pytest.raises(ValueError, match=f"'{selector}' matches no tensor of this model"):
            export_gguf(model.state_dict(), model.config, tmp_path / "x.gguf", "q8_0", smollm2_gguf,
                        tensor_precision=((selector, "f16"),))
    assert not list(tmp_path.iterdir())  # nothing written
