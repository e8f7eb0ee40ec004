"""[lora] (docs/lora.md): the trainer's frozen base is the engine GGUF's tensors bit for bit, the adapter reaches
llama.cpp as a GGUF LoRA adapter (convert_lora_to_gguf.py's layout) and the hf engine in process, and every sync's
proof passes on a good sync and fails, naming the version, on a withheld, stale, zeroed or wrongly scaled adapter.
Tiny random llama (conftest.py), in process."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from nearpolicy.engines.base import LoraAdapter
from nearpolicy.engines.gguf.dequantize import unpermute
from nearpolicy.engines.gguf.export import _permute, convert_state
from nearpolicy.engines.gguf.lora_adapter import LLAMA_TARGETS, export_lora_gguf
from nearpolicy.model.lora import attach_lora, load_engine_base
from nearpolicy.training.lora_sync import (PROOF_TOLERANCE, AdapterProof, AdapterProofError, engine_logprobs,
                                           policy_logprobs)


def _model(tiny_model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)


def _lora_on(tiny_model_dir: Path, gguf_path: Path, rank: int = 4, alpha: float = 8.0):
    model = _model(tiny_model_dir)
    load_engine_base(model, gguf_path)
    return attach_lora(model, rank, alpha, 0.0, LLAMA_TARGETS, seed=0, base_gguf=gguf_path)


def _randomise(lora, std: float, seed: int) -> None:
    """lora_B ~ N(0, std^2) (lora_A keeps PEFT's init): an adapter that moves the probe by about 10 std nats/token."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, module in lora.lora_layers():
            w = module.lora_B["default"].weight
            w.copy_(torch.randn(w.shape, generator=g) * std)


def _probe(n: int = 3, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    rng = np.random.default_rng(seed)
    return [(rng.integers(3, 49152, 12).tolist(), rng.integers(3, 49152, 10).tolist()) for _ in range(n)]


def _engine(path: Path, kv_cache: str = "f32"):
    from nearpolicy.engines.llamacpp import LlamaCppEngine

    return LlamaCppEngine(path, max_context=128, max_parallel_sequences=4, threads=1, kv_cache=kv_cache,
                          adaptive_threads=False)


def _sync(engine, lora, folder: Path, version: int, name: str = "adapter.gguf") -> LoraAdapter:
    export_lora_gguf(lora.adapter_tensors(), lora.model.config, folder / name, lora.alpha)
    source = LoraAdapter(gguf=str(folder / name), scale=lora.scale)
    engine.update_weights(source, version)
    return source


# -- the frozen base ------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("precision", ["q8_0", "q4_1"])
def test_the_trainers_base_is_the_engine_gguf_tensor_by_tensor(tiny_model_dir, tiny_gguf_factory, precision):
    """Every tensor of the engine's GGUF, dequantized by gguf-py and unpermuted, equals the trainer's float32 weight
    bit for bit (before and after the adapter is attached, the base_layer then), and exporting the trainer's base at
    the same precision reproduces the file's bytes (the engine computes with exactly what the trainer holds)."""
    path = tiny_gguf_factory(precision)
    lora = _lora_on(tiny_model_dir, path)
    base = lora.base_state()
    reader = gguf.GGUFReader(str(path))
    config = lora.model.config
    from nearpolicy.engines.gguf.dequantize import gguf_names

    by_gguf = {v: k for k, v in gguf_names(list(base), config).items()}
    assert len(by_gguf) == len(reader.tensors) == 2 * 9 + 2  # 9 per block, token_embd, output_norm (tied head)
    quantized = 0
    for t in reader.tensors:
        hf_name = by_gguf[t.name]
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
        if "attn_q" in t.name:
            w = unpermute(w, config.num_attention_heads)
        elif "attn_k" in t.name:
            w = unpermute(w, config.num_key_value_heads)
        assert torch.equal(torch.from_numpy(np.array(w, dtype=np.float32)), base[hf_name]), t.name
        quantized += t.tensor_type.name == precision.upper()
    assert quantized == 2 * 7 + 1  # every projection and the embeddings
    again = {name: array for name, array, _ in convert_state(base, config, precision, None, (), "nearest", 0)}
    for t in reader.tensors:
        assert np.array_equal(again[t.name].view(np.uint8).ravel(), np.asarray(t.data).view(np.uint8).ravel()), t.name


def test_attach_lora_freezes_the_base_and_starts_at_the_base(tiny_model_dir, tiny_gguf_factory):
    """Only lora_A / lora_B train; lora_B starts at zero, so the adapted policy is the base exactly; the merged and
    plain copies carry the base (plus scale B A when merged)."""
    lora = _lora_on(tiny_model_dir, tiny_gguf_factory("q8_0"))
    names = [n for n, p in lora.model.named_parameters() if p.requires_grad]
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    assert len(names) == 2 * 7 * 2  # A and B for 7 targets in 2 blocks
    probe = _probe()
    with lora.base_only():
        base = policy_logprobs(lora.model, probe)
    assert np.array_equal(policy_logprobs(lora.model, probe), base)
    _randomise(lora, 0.05, 1)
    merged = policy_logprobs(lora.plain_model(merged=True), probe)
    assert np.max(np.abs(merged - policy_logprobs(lora.model, probe))) < 1e-4
    assert np.array_equal(policy_logprobs(lora.plain_model(merged=False), probe), base)


# -- the adapter file -----------------------------------------------------------------------------------------------
def test_the_adapter_gguf_has_llama_cpps_layout(tiny_model_dir, tiny_gguf_factory, tmp_path):
    """convert_lora_to_gguf.py's layout: general.type adapter, adapter.type lora, adapter.lora.alpha; per target
    "<base>.lora_a" = A (ne [in, r]) and "<base>.lora_b" = B (ne [r, out]) at F32, B's rows q / k-permuted."""
    lora = _lora_on(tiny_model_dir, tiny_gguf_factory("q8_0"))
    _randomise(lora, 0.05, 2)
    export_lora_gguf(lora.adapter_tensors(), lora.model.config, tmp_path / "a.gguf", lora.alpha)
    reader = gguf.GGUFReader(str(tmp_path / "a.gguf"))
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert fields == {"general.architecture": "llama", "general.type": "adapter", "adapter.type": "lora",
                      "adapter.lora.alpha": 8.0}
    tensors = {t.name: t for t in reader.tensors}
    assert len(tensors) == 2 * 7 * 2 and {t.tensor_type for t in tensors.values()} == {gguf.GGMLQuantizationType.F32}
    a, b = lora.adapter_tensors()["model.layers.1.self_attn.q_proj.weight"]
    assert tensors["blk.1.attn_q.weight.lora_a"].shape.tolist() == [64, 4]  # ne: [in, r]
    assert tensors["blk.1.attn_q.weight.lora_b"].shape.tolist() == [4, 64]  # ne: [r, out]
    assert np.array_equal(np.asarray(tensors["blk.1.attn_q.weight.lora_a"].data), a.numpy())
    assert np.array_equal(np.asarray(tensors["blk.1.attn_q.weight.lora_b"].data), _permute(b.numpy(), 4))
    _, bk = lora.adapter_tensors()["model.layers.0.self_attn.k_proj.weight"]
    assert np.array_equal(unpermute(np.asarray(tensors["blk.0.attn_k.weight.lora_b"].data), 2), bk.numpy())
    _, bv = lora.adapter_tensors()["model.layers.0.self_attn.v_proj.weight"]
    assert np.array_equal(np.asarray(tensors["blk.0.attn_v.weight.lora_b"].data), bv.numpy())  # not permuted


# -- delivery -------------------------------------------------------------------------------------------------------
def test_llama_cpp_with_the_adapter_computes_the_trainers_adapted_policy(tiny_model_dir, tiny_gguf_factory,
                                                                         tmp_path):
    """On an f32 base with an f32 KV cache, llama.cpp with the adapter file matches the trainer's adapted policy to
    float32 summation noise (mean |delta| < 1e-5 nats, while the adapter moves the probe by about 0.5): shapes,
    q / k permutation and the alpha / r scale are right. Swapping adapters (a second version) needs no model reload."""
    lora = _lora_on(tiny_model_dir, tiny_gguf_factory("f32"))
    engine = _engine(tiny_gguf_factory("f32"))
    probe = _probe()
    try:
        with lora.base_only():
            base = policy_logprobs(lora.model, probe)
        for version, seed in ((1, 3), (2, 4)):
            _randomise(lora, 0.05, seed)
            _sync(engine, lora, tmp_path, version)
            ours, theirs = policy_logprobs(lora.model, probe), engine_logprobs(engine, probe)
            assert np.mean(np.abs(ours - base)) > 0.1
            assert np.mean(np.abs(theirs - ours)) < 1e-5 and np.max(np.abs(theirs - ours)) < 5e-5
            assert engine.version == version
    finally:
        engine.close()


def test_an_adapter_swap_needs_the_kv_cache_cleared(tiny_model_dir, tiny_gguf_factory, tmp_path):
    """llama_set_adapters_lora leaves the KV cache alone: a prefix decoded under adapter 1 and continued under adapter
    2 gives other logits than a fresh decode under adapter 2 (k_proj / v_proj adapted), so the engine clears every
    cache on a swap; after it, the engine's scores equal a fresh engine's with the same adapter."""
    from nearpolicy.engines.llama_adapter import LlamaAdapter
    from nearpolicy.engines.llama_lib import load_lib

    lora = _lora_on(tiny_model_dir, tiny_gguf_factory("f32"))
    engine = _engine(tiny_gguf_factory("f32"))
    ids = _probe(1)[0][0] + _probe(1)[0][1]
    try:
        _randomise(lora, 0.05, 5)
        _sync(engine, lora, tmp_path, 1, "one.gguf")
        ctx = engine._sampler
        ctx.reset()
        ctx.decode([(t, i, 0, False) for i, t in enumerate(ids[:-1])])  # the prefix's K / V under adapter 1
        _randomise(lora, 0.05, 6)
        export_lora_gguf(lora.adapter_tensors(), lora.model.config, tmp_path / "two.gguf", lora.alpha)
        two = LlamaAdapter(load_lib(), engine._model, tmp_path / "two.gguf")
        two.set_on(ctx.ctx)  # no cache clear
        stale = ctx.decode([(ids[-1], len(ids) - 1, 0, True)])[0]
        ctx.reset()
        fresh = ctx.decode([(t, i, 0, i == len(ids) - 1) for i, t in enumerate(ids)])[0]
        assert np.max(np.abs(stale - fresh)) > 1e-2  # the old adapter's keys and values survived
        engine._adapter.set_on(ctx.ctx)
        two.free()
        _sync(engine, lora, tmp_path, 2, "two.gguf")  # the engine's swap clears the caches
        other = _engine(tiny_gguf_factory("f32"))
        try:
            other.update_weights(LoraAdapter(gguf=str(tmp_path / "two.gguf"), scale=lora.scale), 2)
            probe = _probe()
            assert np.array_equal(engine_logprobs(engine, probe), engine_logprobs(other, probe))
        finally:
            other.close()
    finally:
        engine.close()


def test_the_hf_engine_applies_the_adapter_in_process(tiny_model_dir, tiny_gguf_factory):
    """The hf fp32 engine on the plain base takes the adapter's tensors (W = W_base + scale B A) and matches the
    trainer's adapted policy to 1e-5 nats/token; a second adapter replaces the first (not added to it)."""
    from nearpolicy.engines.hf import HFEngine

    lora = _lora_on(tiny_model_dir, tiny_gguf_factory("q8_0"))
    engine = HFEngine(lora.plain_model(merged=False), {2}, dtype="fp32")
    probe = _probe()
    for version, seed in ((1, 7), (2, 8)):
        _randomise(lora, 0.05, seed)
        engine.update_weights(LoraAdapter(tensors=lora.adapter_tensors(), scale=lora.scale), version)
        assert np.mean(np.abs(engine_logprobs(engine, probe) - policy_logprobs(lora.model, probe))) < 1e-5
    with pytest.raises(TypeError, match="tensors"):
        engine.update_weights(LoraAdapter(gguf="x.gguf"), 3)


# -- the proof ------------------------------------------------------------------------------------------------------
@pytest.fixture
def proof_setup(tiny_model_dir, tiny_gguf_factory, tmp_path):
    """A q8_0 engine (f16 KV cache, the default) and the trainer's LoRA policy on its base; the proof at the q8_0
    tolerance with the engine's base scores measured; adapter version 0 (lora_B = 0) synced and proven."""
    path = tiny_gguf_factory("q8_0")
    lora = _lora_on(tiny_model_dir, path)
    engine = _engine(path, kv_cache="f16")
    proof = AdapterProof(lora, _probe(), PROOF_TOLERANCE["q8_0"])
    proof.measure_engine_base(engine)
    _sync(engine, lora, tmp_path, 0)
    proof.check(engine, 0)
    yield lora, engine, proof, tmp_path
    engine.close()


def test_the_proof_passes_on_good_syncs(proof_setup):
    """Version 0 (the base) and two moved adapters pass; the gap stays inside the tolerance while the adapter moves
    the probe far more than it."""
    lora, engine, proof, folder = proof_setup
    for version, seed in ((1, 11), (2, 12)):
        _randomise(lora, 0.05, seed)
        _sync(engine, lora, folder, version)
        metrics = proof.check(engine, version)
        assert metrics["lora/proof_gap"] <= PROOF_TOLERANCE["q8_0"] / 2
        assert metrics["lora/proof_shift"] > 0.2 and metrics["lora/proof_engine_shift"] > 0.2


def test_the_proof_fails_when_the_adapter_is_withheld(proof_setup):
    lora, engine, proof, folder = proof_setup
    _randomise(lora, 0.05, 13)
    with pytest.raises(AdapterProofError, match=r"version 1 .*withheld") as caught:
        proof.check(engine, 1)  # the engine was never given version 1
    assert caught.value.version == 1 and caught.value.engine_shift == 0.0
    assert "stale" not in str(caught.value)


def test_the_proof_fails_on_a_stale_adapter(proof_setup):
    lora, engine, proof, folder = proof_setup
    _randomise(lora, 0.05, 14)
    _sync(engine, lora, folder, 1)
    proof.check(engine, 1)
    _randomise(lora, 0.05, 15)  # version 2 in the trainer; the engine keeps version 1's adapter
    with pytest.raises(AdapterProofError, match=r"version 2 .*adapter version 1 .*stale"):
        proof.check(engine, 2)


def test_the_proof_fails_on_a_zeroed_adapter(proof_setup):
    lora, engine, proof, folder = proof_setup
    _randomise(lora, 0.05, 16)
    zeroed = {name: (a, torch.zeros_like(b)) for name, (a, b) in lora.adapter_tensors().items()}
    export_lora_gguf(zeroed, lora.model.config, folder / "zero.gguf", lora.alpha)
    engine.update_weights(LoraAdapter(gguf=str(folder / "zero.gguf"), scale=lora.scale), 1)
    with pytest.raises(AdapterProofError, match=r"version 1 .*zeroed"):
        proof.check(engine, 1)


def test_the_proof_fails_on_a_wrongly_scaled_adapter(proof_setup):
    """An adapter that arrives, but computes another policy (alpha doubled in the file), fails agreement."""
    lora, engine, proof, folder = proof_setup
    _randomise(lora, 0.1, 17)  # the adapter moves the probe by about 0.9 nats/token; doubled, by about 1.8
    export_lora_gguf(lora.adapter_tensors(), lora.model.config, folder / "x2.gguf", 2 * lora.alpha)
    engine.update_weights(LoraAdapter(gguf=str(folder / "x2.gguf"), scale=lora.scale), 1)
    with pytest.raises(AdapterProofError, match=r"version 1 .*above the tolerance"):
        proof.check(engine, 1)
