"""engines/factory.py: the one place an engine kind becomes an engine; files.py: atomic writes; runs.folder.last_step."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from nearpolicy.config.schema import Config
from nearpolicy.engines.factory import ENGINES, EngineInputs, EngineRequest, build_engine, engine_kind, kind_of
from nearpolicy.files import atomic_path, write_atomically
from nearpolicy.types import GenerationRequest, SamplingParams

PROMPT = [1, 9690, 28, 2]


@pytest.fixture
def tiny_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()


def test_unknown_kinds_precisions_and_missing_inputs_are_named():
    with pytest.raises(ValueError, match="unknown engine kind 'sglang'; valid: llamacpp, hf, vllm"):
        build_engine(EngineRequest("sglang", "fp32"), EngineInputs())
    with pytest.raises(ValueError, match="engine 'hf': unknown precision 'q8_0'; valid: fp32, bf16"):
        build_engine(EngineRequest("hf", "q8_0"), EngineInputs())
    with pytest.raises(ValueError, match="engine kind 'llamacpp' needs EngineInputs.gguf"):
        build_engine(EngineRequest("llamacpp", "q8_0"), EngineInputs())
    with pytest.raises(ValueError, match="registered twice"):
        engine_kind("hf", ("fp32",), "state_dict", "hf_dtype")(lambda request, inputs: None)


def test_the_hf_kind_builds_the_engine_it_describes(tiny_model):
    engine = build_engine(EngineRequest("hf", "bf16", max_parallel_sequences=3, version=5, logit_noise=0.25),
                          EngineInputs(model=tiny_model, stop_ids={2}))
    assert (engine.version, engine.logit_noise, engine.max_parallel) == (5, 0.25, 3)
    assert next(engine.model.parameters()).dtype == torch.bfloat16
    assert next(tiny_model.parameters()).dtype == torch.float32  # the trainer's policy is copied, not cast


def test_a_llamacpp_request_opens_in_process_or_in_its_own_process(tiny_gguf_factory, tmp_path):
    from nearpolicy.engines.llamacpp import LlamaCppEngine
    from nearpolicy.engines.process import ProcessEngine

    request = EngineRequest("llamacpp", "f32", max_context=128, max_parallel_sequences=2, threads=1, kv_cache="f32",
                            isolated=False)
    inputs = EngineInputs(tiny_gguf_factory("f32"), workdir=tmp_path, probe_prompt=PROMPT)
    local = build_engine(request, inputs)
    child = build_engine(EngineRequest(**{**request.__dict__, "isolated": True}), inputs)
    try:
        assert isinstance(local, LlamaCppEngine) and isinstance(child, ProcessEngine)
        assert child.label == "llamacpp:f32" and (tmp_path / "llamacpp.log").exists()
        sampling = SamplingParams(1.0, 1.0, 0, 6)
        a = local.generate([GenerationRequest(0, tuple(PROMPT), 2)], sampling, seed=3)
        b = child.generate([GenerationRequest(0, tuple(PROMPT), 2)], sampling, seed=3)
        assert [r.completion_ids for r in a] == [r.completion_ids for r in b]
        for x, y in zip(a, b, strict=True):
            assert x.rollout_logprobs == pytest.approx(y.rollout_logprobs, abs=1e-6)
    finally:
        local.close()
        child.close()


def test_a_new_kind_is_one_registered_builder_and_diagnose_and_config_checks_read_its_facts(tiny_model):
    """What adding an engine kind takes: its module's adapter and one @engine_kind entry; diagnose's candidate
    grammar and the checks read the new kind's facts without an edit."""
    from nearpolicy.config.checks import check_sections_agree
    from nearpolicy.diagnosis.candidates import parse_candidate
    from nearpolicy.engines.hf import HFEngine

    built = []

    @engine_kind("toy", ("fp32",), "state_dict", "hf_dtype", episodes=False)
    def _toy(request, inputs):
        built.append(request)
        return HFEngine(inputs.model, inputs.stop_ids)

    try:
        engine = build_engine(EngineRequest("toy", "fp32"), EngineInputs(model=tiny_model, stop_ids={2}))
        assert isinstance(engine, HFEngine) and built[0].kind == "toy"
        assert parse_candidate("toy:fp32").engine == "toy"
        with pytest.raises(ValueError, match="cannot use option 'kv_cache=f32'"):
            parse_candidate("toy:fp32,kv_cache=f32")  # the kind honours no llama.cpp options
        cfg = SimpleNamespace(engine=SimpleNamespace(kind="toy"), algorithm=None, episode=SimpleNamespace(enabled=True))
        with pytest.raises(ValueError, match="episode.enabled is not supported with engine.kind = 'toy'"):
            check_sections_agree(cfg)
    finally:
        ENGINES.pop("toy", None)


def test_the_config_request_carries_the_kinds_own_precision_key_and_options():
    cfg = Config()
    e = cfg.engine.model_copy(update={"kind": "hf", "hf_dtype": "bf16", "tensor_precision": {"blk.0": "f16"}})
    request = e.request(max_context=512, threads=3, seed=7)
    assert (request.kind, request.precision, request.tensor_precision, request.threads) == ("hf", "bf16", (), 3)
    e = cfg.engine.model_copy(update={"precision": "q4_1", "tensor_precision": {"blk.0": "f16"}})
    request = e.request(max_context=512, threads=3, seed=7)
    assert (request.precision, request.tensor_precision, request.label) == ("q4_1", (("blk.0", "f16"),),
                                                                            "llamacpp:q4_1 (blk.0=f16)")
    assert kind_of("llamacpp").loads == "gguf" and kind_of("vllm").loads == "state_dict"


def test_an_atomic_write_that_fails_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "state.json"
    write_atomically(target, '{"step": 1}\n')
    with pytest.raises(RuntimeError, match="disk"):
        with atomic_path(target) as tmp:
            tmp.write_text("half a fil")
            raise RuntimeError("disk full")
    assert target.read_text() == '{"step": 1}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]
    write_atomically(target, b"\x00\x01")
    assert target.read_bytes() == b"\x00\x01"
    with atomic_path(target, durable=True) as tmp:  # fsynced before the rename, the folder after
        tmp.write_text("durable")
    assert target.read_text() == "durable" and sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_last_step_reads_the_last_complete_line(tmp_path):
    from nearpolicy.runs.folder import last_step

    assert last_step(tmp_path) is None
    rows = [json.dumps({"step": s, "x": 1.0}) for s in range(3)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(rows) + '\n{"step": 3, "x": 1')  # a cut-short last line
    assert last_step(tmp_path) == 2
