"""Weight sync by rewriting the engine's GGUF in place (engines/gguf/inplace.py, LlamaCppEngine.update_weights):
the rewritten file is byte for byte a fresh export, an engine mapping it behaves exactly like a fresh engine on the
new weights with no cache of the old ones (invariant 9), and every case the rewrite cannot serve falls back to a
whole file and a reload."""

from __future__ import annotations

import os

import pytest
import torch

from nearpolicy.engines.gguf import export as gguf_export, inplace as gguf_inplace
from nearpolicy.engines.base import RewrittenGGUF, file_id
from nearpolicy.engines.gguf.export import export_gguf
from nearpolicy.engines.gguf.inplace import EngineGGUF
from nearpolicy.engines.llamacpp import LlamaCppEngine
from nearpolicy.types import GenerationRequest, SamplingParams

PROMPT = [1, 504, 3287, 28, 1085, 6001]
COMPLETION = [400, 500, 600, 700, 2]
SAMPLING = SamplingParams(1.0, 1.0, 0, 8)


@pytest.fixture
def model(tiny_model_dir):
    from nearpolicy.model.load import load_policy

    return load_policy(str(tiny_model_dir))[0]


def _perturb(model, scale: float = 0.05) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))


def _engine(path, **kw) -> LlamaCppEngine:
    return LlamaCppEngine(path, max_context=128, max_parallel_sequences=4, threads=2, kv_cache="f32", **kw)


def _writer(model, folder, template, precision="q8_0", **kw) -> EngineGGUF:
    return EngineGGUF(model, folder, precision, (), template, None, **kw)


@pytest.mark.parametrize("precision", ["q8_0", "q4_1", "f32"])
def test_rewritten_file_is_a_fresh_export_and_the_engine_a_fresh_engine(model, smollm2_gguf, tmp_path, precision):
    torch.manual_seed(0)
    write = _writer(model, tmp_path / "engine", smollm2_gguf, precision)
    first = write()
    assert first == tmp_path / "engine" / f"policy-{precision}.gguf"  # the first sync writes the whole file
    engine = _engine(first)
    before = engine.score(PROMPT, COMPLETION, SAMPLING)
    for version in (1, 2):
        _perturb(model)
        source = write()
        assert source == RewrittenGGUF(str(first), file_id(first))  # same file, tensors rewritten
        fresh_path = tmp_path / f"fresh-{version}.gguf"
        export_gguf(model.state_dict(), model.config, fresh_path, precision, template_gguf=smollm2_gguf)
        assert first.read_bytes() == fresh_path.read_bytes()
        engine.update_weights(source, version)
        fresh = _engine(fresh_path, version=version)
        assert engine.version == version
        after = engine.score(PROMPT, COMPLETION, SAMPLING)
        assert after == fresh.score(PROMPT, COMPLETION, SAMPLING)
        assert max(abs(a - b) for a, b in zip(after, before)) > 1e-3  # the new weights are in use
        requests = [GenerationRequest(0, tuple(PROMPT), 3)]
        assert engine.generate(requests, SAMPLING, seed=7) == fresh.generate(requests, SAMPLING, seed=7)
        assert engine.greedy([PROMPT], 6) == fresh.greedy([PROMPT], 6)
        before = after
        fresh.close()
    engine.close()


def test_no_kv_cache_of_the_old_weights_survives_an_in_place_sync(model, smollm2_gguf, tmp_path):
    """A continuation of the previous call keeps its KV cache (kv_reuse) until the weights change in place."""
    write = _writer(model, tmp_path, smollm2_gguf)
    engine = _engine(write())
    first = engine.generate([GenerationRequest(0, tuple(PROMPT), 1)], SAMPLING, seed=1)[0]
    continued = GenerationRequest(0, tuple(PROMPT) + tuple(first.completion_ids) + (28,), 1)
    reused = engine.generate([continued], SAMPLING, seed=2)[0]
    assert reused.extras.get("prefill_reused", 0) > 0  # the cache is kept between calls on the same weights
    engine.generate([GenerationRequest(0, tuple(PROMPT), 1)], SAMPLING, seed=1)
    _perturb(model)
    engine.update_weights(write(), 1)
    after = engine.generate([continued], SAMPLING, seed=2)[0]
    assert after.extras.get("prefill_reused", 0) == 0
    fresh = _engine(tmp_path / "policy-q8_0.gguf", version=1)
    assert after == fresh.generate([continued], SAMPLING, seed=2)[0]
    engine.close()
    fresh.close()


def test_an_engine_that_does_not_map_the_file_reloads_it(model, smollm2_gguf, tmp_path):
    write = _writer(model, tmp_path / "engine", smollm2_gguf)
    path = write()
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(path.read_bytes())
    other = _engine(copy)  # another file: its mapping never sees the rewrite
    buffered = _engine(path, extra_buffers=True)  # extra buffers may hold copies of the weights
    _perturb(model)
    source = write()
    assert isinstance(source, RewrittenGGUF)
    fresh = _engine(path)
    want = fresh.score(PROMPT, COMPLETION, SAMPLING)
    for engine in (other, buffered):
        engine.update_weights(source, 1)
        assert engine.path == path and engine.score(PROMPT, COMPLETION, SAMPLING) == want
        engine.close()
    fresh.close()


def test_a_build_that_offloads_weights_reloads_on_a_rewrite(model, smollm2_gguf, tmp_path, monkeypatch):
    """A GPU build of llama.cpp copies the weights off the mapped file: such an engine reloads instead."""
    import llama_cpp

    write = _writer(model, tmp_path, smollm2_gguf)
    path = write()
    monkeypatch.setattr(llama_cpp, "llama_supports_gpu_offload", lambda: True)
    engine = _engine(path)
    loads = []
    real_load = engine._load
    monkeypatch.setattr(engine, "_load", lambda p: (loads.append(p), real_load(p)))
    _perturb(model)
    engine.update_weights(write(), 1)
    assert loads == [path] and engine.version == 1
    engine.close()


def test_a_replaced_file_is_written_whole_again(model, smollm2_gguf, tmp_path):
    write = _writer(model, tmp_path, smollm2_gguf)
    path = write()
    engine = _engine(path)
    export_gguf(model.state_dict(), model.config, path, "q8_0", template_gguf=smollm2_gguf)  # a new file (inode)
    _perturb(model)
    assert write() == path  # not rewritten: the engine maps the old file
    engine.update_weights(path, 1)
    assert isinstance(write(), RewrittenGGUF)  # and in place again from then on
    engine.close()


def test_a_layout_that_fails_its_check_turns_the_rewrite_off(model, smollm2_gguf, tmp_path, monkeypatch):
    logged = []
    monkeypatch.setattr(gguf_inplace, "data_slots", lambda order, tensors, size, alignment=32: {
        name: gguf_inplace.TensorSlot(0, tensors[name][0].nbytes, tensors[name][1]) for name in order})
    write = _writer(model, tmp_path, smollm2_gguf, log=logged.append)
    assert write() == tmp_path / "policy-q8_0.gguf"
    assert write() == tmp_path / "policy-q8_0.gguf"  # whole again, never in place
    assert write.in_place is False and len(logged) == 1 and "tensor layout" in logged[0]


def test_a_failed_rewrite_raises_and_the_next_sync_writes_the_whole_file(model, smollm2_gguf, tmp_path, monkeypatch):
    write = _writer(model, tmp_path, smollm2_gguf)
    path = write()
    engine = _engine(path)
    calls = []

    def failing(fd, data, offset):
        calls.append(offset)
        if len(calls) == 3:
            raise OSError(5, "Input/output error")
        return os.pwrite(fd, data, offset)

    monkeypatch.setattr(gguf_inplace.os, "pwrite", failing)
    _perturb(model)
    with pytest.raises(OSError, match="could not write the engine GGUF .*policy-q8_0.gguf .*Input/output error.*; "
                                      "policy-q8_0.gguf is partly rewritten"):
        write()
    monkeypatch.undo()
    source = write()
    assert source == path  # written whole: a new file, which the engine loads
    engine.update_weights(source, 1)
    fresh_path = tmp_path / "fresh.gguf"
    export_gguf(model.state_dict(), model.config, fresh_path, "q8_0", template_gguf=smollm2_gguf)
    fresh = _engine(fresh_path)
    assert engine.score(PROMPT, COMPLETION, SAMPLING) == fresh.score(PROMPT, COMPLETION, SAMPLING)
    engine.close()
    fresh.close()


def test_rewrite_refuses_tensors_that_do_not_fit_before_writing(model, smollm2_gguf, tmp_path):
    write = _writer(model, tmp_path, smollm2_gguf)
    path = write()
    original = path.read_bytes()
    name = next(iter(write.slots))
    array, qtype = torch.zeros(3).numpy(), write.slots[name].qtype
    tensors = {n: (torch.zeros(s.nbytes, dtype=torch.uint8).numpy(), s.qtype) for n, s in write.slots.items()}
    tensors[name] = (array, qtype)
    with pytest.raises(ValueError, match=f"{name}: .* does not fit"):
        gguf_inplace.rewrite(path, write.slots, tensors)
    with pytest.raises(ValueError, match="not the file's tensors"):
        gguf_inplace.rewrite(path, write.slots, {})
    assert path.read_bytes() == original


def test_an_engine_in_its_own_process_takes_the_rewrite(model, smollm2_gguf, tmp_path):
    """The trainer's engine runs in a child process (engines/process.py): the rewrite crosses the boundary and the
    child's mapping reads the new bytes."""
    from nearpolicy.engines.llamacpp import EngineSpec
    from nearpolicy.engines.process import ProcessEngine

    write = _writer(model, tmp_path / "engine", smollm2_gguf)
    path = write()
    child = ProcessEngine(EngineSpec(str(path), 0, 128, 4, 1, "f32", False), "llamacpp:q8_0",
                          log_path=tmp_path / "llamacpp.log")
    try:
        before = child.score(PROMPT, COMPLETION, SAMPLING)
        _perturb(model)
        source = write()
        assert isinstance(source, RewrittenGGUF)
        child.update_weights(source, 1)
        fresh = _engine(path)
        after = child.score(PROMPT, COMPLETION, SAMPLING)
        assert child.version == 1 and after == fresh.score(PROMPT, COMPLETION, SAMPLING) and after != before
        fresh.close()
    finally:
        child.close()


def test_a_failed_whole_write_keeps_the_previous_file(model, smollm2_gguf, tmp_path, monkeypatch):
    write = _writer(model, tmp_path, smollm2_gguf)
    path = write()
    original = path.read_bytes()
    write.slots = None  # as after a failed rewrite: the next sync writes the whole file

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gguf_export, "export_gguf", full)
    _perturb(model)
    with pytest.raises(OSError, match="No space left on device.*; the previous policy-q8_0.gguf is unchanged"):
        write()
    assert path.read_bytes() == original
