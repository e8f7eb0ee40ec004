"""Precision alignment (model/aligned.py, ops/ggml_quant.py): the quantizer is ggml's bit for bit (the pinned library's
own AVX2 `quantize_row_q8_0` / `quantize_row_q8_1`, called through ctypes, and gguf-py's reference Q8_0); the
aligned forward of the tiny llama matches the llama.cpp engine's log-probs within a stated bound for every
quantized type, and far better than the plain forward; the straight-through gradient is the fp32 gradient where
the quantizer is the identity; removing the alignment (or never adding it) changes nothing."""

from __future__ import annotations

import ctypes
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from nearpolicy.model.aligned import align_model, engine_weight, module_precisions
from nearpolicy.batching import collate
from nearpolicy.ops.ggml_quant import fake_quant_q8, q8_1_sum_residual, quantize_q8_blocks, straight_through
from nearpolicy.model.policy import sequence_logprobs
from nearpolicy.types import Rollout, SamplingParams

SAMPLING = SamplingParams()


def _ggml_cpu():
    import llama_cpp

    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-cpu.so"))
    for f in (lib.quantize_row_q8_0, lib.quantize_row_q8_1):
        f.argtypes, f.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64], None
    return lib


def _rows(seed: int = 0) -> np.ndarray:
    """[64, 1024] float32 rows over 12 orders of magnitude, a zero block and exact rounding ties."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((64, 1024)) * rng.lognormal(0, 3, (64, 1))).astype(np.float32)
    x[0, :32] = 0.0
    x[1, :32] = np.arange(32, dtype=np.float32) * 0.5  # q = x * 127 / 15.5: ties at many points
    x[1, 31] = 127.0
    return x


def test_q8_0_quantizer_is_the_pinned_librarys_avx2_routine_bit_for_bit() -> None:
    x = _rows()
    out = np.zeros(x.size // 32 * 34, np.uint8)
    _ggml_cpu().quantize_row_q8_0(x.ctypes.data, out.ctypes.data, x.size)
    blocks = out.reshape(64, -1, 34)
    q, _, d16 = quantize_q8_blocks(torch.from_numpy(x))
    assert np.array_equal(q.numpy(), blocks[..., 2:].view(np.int8).astype(np.float32))
    assert np.array_equal(d16.numpy()[..., 0], np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0])
    ref = quantize_q8_blocks(torch.from_numpy(x), "ref")[0]
    assert int((ref != q).sum()) > 0  # the two rules do differ on these rows (ties, 1 / d vs 127 / amax)


def test_q8_1_quantizer_and_block_sums_are_the_pinned_librarys_bit_for_bit() -> None:
    x = _rows(1)
    out = np.zeros(x.size // 32 * 36, np.uint8)
    _ggml_cpu().quantize_row_q8_1(x.ctypes.data, out.ctypes.data, x.size)
    blocks = out.reshape(64, -1, 36)
    q, _, d16 = quantize_q8_blocks(torch.from_numpy(x))
    assert np.array_equal(q.numpy(), blocks[..., 4:].view(np.int8).astype(np.float32))
    s = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0].astype(np.float32)
    ours = q8_1_sum_residual(torch.from_numpy(x)) + (d16 * q.sum(-1, keepdim=True))[..., 0]
    assert np.array_equal(ours.numpy(), s)


def test_reference_rule_is_gguf_q8_0_bit_for_bit() -> None:
    x = _rows(2)
    packed = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0).reshape(64, -1, 34)
    q, _, d16 = quantize_q8_blocks(torch.from_numpy(x), "ref")
    assert np.array_equal(q.numpy(), packed[..., 2:].view(np.int8).astype(np.float32))
    assert np.array_equal(d16.numpy()[..., 0], np.ascontiguousarray(packed[..., :2]).view(np.float16)[..., 0])
    assert np.array_equal(fake_quant_q8(torch.from_numpy(x), "ref").numpy(),
                          gguf.quants.dequantize(packed.reshape(64, -1), gguf.GGMLQuantizationType.Q8_0))


def test_quantizer_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="multiple of the q8 block size 32"):
        quantize_q8_blocks(torch.ones(3, 40))
    with pytest.raises(ValueError, match="float32"):
        quantize_q8_blocks(torch.ones(3, 32, dtype=torch.float64))
    with pytest.raises(ValueError, match="unknown q8 rounding rule"):
        quantize_q8_blocks(torch.ones(3, 32), "floor")


@pytest.mark.parametrize("precision", ["q8_0", "q4_1", "q4_0"])
def test_engine_weight_is_the_gguf_files_dequantized_tensor(precision, tiny_model_dir, tiny_gguf_factory) -> None:
    """The weight the aligned forward uses is the tensor llama.cpp reads from the exported file, bit for bit."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    reader = gguf.GGUFReader(tiny_gguf_factory(precision))
    tensor = next(t for t in reader.tensors if t.name == "blk.1.ffn_down.weight")
    stored = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type).reshape(64, 128)
    deq, mins = engine_weight(model.model.layers[1].mlp.down_proj.weight.detach(), precision)
    assert np.array_equal(deq.numpy(), stored)
    assert (mins is not None) == (precision == "q4_1")


# Measured on the tiny llama (random weights, initializer_range 0.2: logits of std 1.6, 60 teacher-forced tokens),
# mean / max |engine - trainer| log-prob, nats, plain -> aligned: f16 0.0024 / 0.0076 -> 0.00043 / 0.0015,
# q8_0 0.057 / 0.16 -> 0.0065 / 0.046, q4_1 0.55 / 1.8 -> 0.0125 / 0.043, mxfp4 0.87 / 2.9 -> 0.043 / 0.14.
# The remainder is rounding flips (docs/aligned.md): float noise of about 1e-6 relative before a rounding point
# moves values across rounding boundaries. Bounds: about 2x the measured aligned error; and aligned at least 4x
# better than plain on the mean.
ENGINE_BOUNDS = {"f16": (0.0015, 0.008), "bf16": (0.0015, 0.03), "q8_0": (0.015, 0.1), "q5_0": (0.08, 0.3),
                 "q4_0": (0.08, 0.4), "q4_1": (0.03, 0.1), "mxfp4": (0.09, 0.3)}


def _teacher_forced(model, prompt: list[int], completion: list[int]) -> np.ndarray:
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits[0].float(), -1)
    pos = torch.arange(len(prompt) - 1, len(prompt) + len(completion) - 1)
    return lp[pos, torch.tensor(completion)].numpy()


@pytest.mark.parametrize("precision", sorted(ENGINE_BOUNDS))
def test_aligned_forward_matches_the_llamacpp_engine(precision, tiny_model_dir, tiny_gguf_factory) -> None:
    from transformers import AutoModelForCausalLM

    from nearpolicy.engines.llamacpp import LlamaCppEngine

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    prompt, completion = torch.randint(3, 49152, (20,), generator=g).tolist(), torch.randint(3, 49152, (40,), generator=g).tolist()
    engine = LlamaCppEngine(tiny_gguf_factory(precision), max_context=128, max_parallel_sequences=1, threads=1,
                            adaptive_threads=False)
    try:
        mu = np.array(engine.score(prompt, completion, SAMPLING))
    finally:
        engine.close()
    plain = np.abs(_teacher_forced(model, prompt, completion) - mu)
    with align_model(model, precision):
        aligned = np.abs(_teacher_forced(model, prompt, completion) - mu)
    mean_bound, max_bound = ENGINE_BOUNDS[precision]
    assert aligned.mean() < mean_bound and aligned.max() < max_bound, (aligned.mean(), aligned.max())
    assert aligned.mean() * 4 < plain.mean(), (aligned.mean(), plain.mean())


def test_straight_through_gradient_is_the_fp32_gradient_where_the_quantizer_is_the_identity(tiny_model_dir) -> None:
    """A q8_0 layer whose weight and input already lie on the q8_0 grid computes exactly the fp32 layer, and the
    straight-through gradients (input and weight) equal the fp32 ones."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    layer = model.model.layers[0].mlp.down_proj  # [64, 128]
    with torch.no_grad():
        layer.weight.copy_(engine_weight(layer.weight.detach(), "q8_0")[0])
    x0 = fake_quant_q8(torch.randn(5, 128, generator=torch.Generator().manual_seed(3)))
    upstream = torch.randn(5, 64, generator=torch.Generator().manual_seed(4))
    grads = []
    for aligned in (False, True):
        layer.weight.grad = None
        x = x0.clone().requires_grad_(True)
        if aligned:
            with align_model(model, "q8_0", kv_cache="f32"):
                y = layer(x)
        else:
            y = torch.nn.functional.linear(x, layer.weight)
        (y * upstream).sum().backward()
        grads.append((y.detach(), x.grad, layer.weight.grad.clone()))
    for plain, aligned in zip(grads[0], grads[1]):
        assert torch.allclose(aligned, plain, rtol=1e-6, atol=1e-7)
    assert float(grads[1][2].norm()) > 0


def test_straight_through_passes_gradient_unchanged_off_the_grid() -> None:
    x = torch.tensor([0.3, -1.7, 2.49], requires_grad=True)
    y = straight_through(x, torch.round(x.detach()))
    assert torch.equal(y, torch.tensor([0.0, -2.0, 2.0]))
    (y * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    assert torch.equal(x.grad, torch.tensor([1.0, 2.0, 3.0]))


@pytest.mark.parametrize("precision, rounding", [("q8_0", "nearest"), ("q4_1", "nearest"), ("q4_1", "stochastic")])
def test_aligned_model_trains_every_parameter_on_the_shared_prompt_path(tiny_model_dir, precision, rounding) -> None:
    """model/policy.py's shared-prompt path runs on the aligned model, agrees with its padded path, and the loss reaches
    every weight (through the straight-through estimators); q4_1's block-sum term once cut the graph of every
    q4_1 layer, so only the tied embeddings trained."""
    from nearpolicy.model.load import load_policy

    model = load_policy(str(tiny_model_dir))[0]
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, 49152, (9,), generator=g).tolist()
    rollouts = [Rollout(0, k, prompt, torch.randint(3, 49152, (n,), generator=g).tolist(), [-10.0] * n, [0] * n,
                        "length") for k, n in enumerate([6, 3, 8])]
    with align_model(model, precision, rounding=rounding, seed=3):
        out = {}
        for shared in (False, True):
            batch = collate(rollouts, 2, 49152, shared_prompt=shared)
            model.zero_grad()
            logprobs, _ = sequence_logprobs(model, batch, SAMPLING)
            torch.where(batch.mask, logprobs, 0.0).sum().backward()
            out[shared] = (logprobs.detach()[batch.mask], {n: p.grad.clone() for n, p in model.named_parameters()})
    assert float((out[True][0] - out[False][0]).abs().max()) < 5e-3  # measured: see docs/aligned.md
    for name, grad in out[True][1].items():
        assert float(grad.norm()) > 0, name
        assert float((grad - out[False][1][name]).norm()) <= 0.05 * float(out[False][1][name].norm()), name


def test_alignment_off_and_removed_change_nothing(tiny_model_dir) -> None:
    from transformers import AutoModelForCausalLM

    from nearpolicy.config.schema import Config

    assert Config().algorithm.precision_alignment == "off"
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    ids = torch.randint(3, 49152, (2, 12), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        before = model(ids).logits
    keys = list(model.state_dict())
    attention = model.config._attn_implementation
    handle = align_model(model, "q4_1", tensor_precision=(("embeddings", "q8_0"),))
    assert handle.precisions["model.embed_tokens"] == "q8_0" and handle.precisions["lm_head"] == "q8_0"
    assert handle.precisions["model.layers.0.self_attn.q_proj"] == "q4_1"
    with torch.no_grad():
        during = model(ids).logits
    assert float((during - before).abs().max()) > 1e-3  # the alignment did act
    with pytest.raises(ValueError, match="already aligned"):
        align_model(model, "q8_0")
    handle.remove()
    with torch.no_grad():
        after = model(ids).logits
    assert torch.equal(after, before)
    assert list(model.state_dict()) == keys and model.config._attn_implementation == attention
    assert not any("forward" in vars(m) for m in model.modules())


def test_config_refuses_alignment_without_a_llamacpp_engine() -> None:
    from nearpolicy.config.schema import ConfigError, load_config

    with pytest.raises(ConfigError, match="precision_alignment"):
        load_config(None, ["algorithm.precision_alignment=engine", "engine.flash_attention=true"])
    assert load_config(None, ["algorithm.precision_alignment=engine"]).algorithm.precision_alignment == "engine"


def test_module_precisions_follow_the_exporters_map(tiny_model_dir) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    got = module_precisions(model, "q4_1", (("blk.1", "f16"), ("mlp", "q8_0")))
    assert got["model.layers.0.self_attn.k_proj"] == "q4_1"
    assert got["model.layers.1.self_attn.k_proj"] == "f16"
    assert got["model.layers.1.mlp.up_proj"] == "q8_0"  # later entries win
    assert got["model.embed_tokens"] == got["lm_head"] == "q4_1"  # tied head: token_embd's type
    with pytest.raises(ValueError, match="kv_cache"):
        align_model(model, "q8_0", kv_cache="q8_0")
