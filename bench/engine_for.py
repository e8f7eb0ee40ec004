"""A "kind:precision" rollout configuration (e.g. "llamacpp:q8_0", "hf:fp32", "vllm:bf16") as a nearpolicy engine
on the policy's weights, built by the package's one engine factory (engines/factory.py). Shared by
bench/workers.py, bench/rollout_throughput.py and bench/vllm_rollouts.py; what differs between kinds is read from
the kind's facts (`kind_of(kind).loads`), never from its name.

Import it as a sibling module (`from engine_for import open_engine`): a script run as `python bench/<script>.py`
has bench/ on its path."""

from __future__ import annotations

from pathlib import Path

from nearpolicy.engines.factory import EngineInputs, EngineRequest, build_engine, kind_of


def open_engine(config: str, model, tokenizer, tmp: Path, batch: int, threads: int):
    """The engine of `config` ("kind:precision") on `model`'s weights, in this process where the kind can be
    (llama.cpp in-process; vLLM always runs in its own), with up to 512 tokens per sequence and `batch` sequences
    per call. A kind that loads GGUF gets the policy exported at `precision` into `tmp`; the others get the
    policy itself with its end-of-generation ids. `tmp` also holds the engine's log and converted weights (vllm).
    Closed by the caller."""
    from nearpolicy.engines.gguf.export import export_model_gguf
    from nearpolicy.model.load import default_model_gguf, stop_token_ids

    kind, precision = config.split(":")
    request = EngineRequest(kind, precision, max_context=512, max_parallel_sequences=batch, threads=threads,
                            isolated=False)
    if kind_of(kind).loads == "gguf":
        gguf = export_model_gguf(model, tmp, precision, (), default_model_gguf(), tokenizer)
        inputs = EngineInputs(gguf=gguf, model=model, workdir=tmp)
    else:
        inputs = EngineInputs(model=model, stop_ids=stop_token_ids(model, tokenizer, default_model_gguf(), tmp),
                              workdir=tmp)
    return build_engine(request, inputs)
