"""Session fixtures shared by all tests: the SmolLM2 tokenizer, a tiny random llama in an HF folder, its GGUFs.

The tiny model (hidden 64, 2 layers, 4 heads, 2 KV heads, vocab 49152, tied embeddings) is random with
initializer_range 0.2, so its next-token distributions are far from uniform (about 9.5 nats of entropy,
against log 49152 = 10.8) while every forward pass stays in the milliseconds.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

TINY_CONFIG = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)


@pytest.fixture
def started_elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """(started, elsewhere): two folders under tmp_path, `started` holding an 8-problem data.jsonl, the current folder
    set to `started` (where a run with a relative task.path starts); move to `elsewhere` to read the run from another
    folder."""
    import json

    started, elsewhere = tmp_path / "started", tmp_path / "elsewhere"
    started.mkdir(), elsewhere.mkdir()
    (started / "data.jsonl").write_text("".join(json.dumps({"prompt": f"{i}+1?", "answer": i + 1}) + "\n"
                                               for i in range(8)))
    monkeypatch.chdir(started)
    return started, elsewhere


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The shipped SmolLM2-135M-Instruct Q4_1 GGUF."""
    from nearpolicy.model.load import default_model_gguf

    return default_model_gguf()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf: Path):
    """The SmolLM2 tokenizer (HF fast tokenizer built from the GGUF's metadata; vocab 49152)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer) -> Path:
    """HF folder (config.json, safetensors, tokenizer) of a random tiny LlamaForCausalLM, torch seed 0."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny_model")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY_CONFIG))
    model.save_pretrained(folder)
    smollm2_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_gguf_factory(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, smollm2_gguf: Path
) -> Callable[[str], Path]:
    """precision -> path of the tiny model exported to GGUF (SmolLM2 GGUF as metadata template), cached."""
    import torch
    from transformers import AutoModelForCausalLM

    from nearpolicy.engines.gguf.export import export_gguf

    folder = tmp_path_factory.mktemp("tiny_gguf")
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    cache: dict[str, Path] = {}

    def make(precision: str) -> Path:
        if precision not in cache:
            out = folder / f"tiny-{precision}.gguf"
            export_gguf(model.state_dict(), model.config, out, precision, template_gguf=smollm2_gguf)
            cache[precision] = out
        return cache[precision]

    return make


def pytest_collection_finish(session):
    """Float32 again once every module is imported: the float64 math modules set the default at import (for their
    module-level constants), and module- or session-scoped fixtures, set up before _default_dtype runs, would
    otherwise build their models in float64 under whichever of those modules was collected last."""
    import torch

    torch.set_default_dtype(torch.float32)


@pytest.fixture(autouse=True)
def _default_dtype(request):
    """Each test runs with its module's DEFAULT_DTYPE (float32 unless the module asks for float64), so the float64
    math modules do not leak their default into the model and trainer tests."""
    import torch

    previous = torch.get_default_dtype()
    torch.set_default_dtype(getattr(request.module, "DEFAULT_DTYPE", torch.float32))
    yield
    torch.set_default_dtype(previous)


def pytest_collection_modifyitems(config, items):
    """Slow tests first (a stable sort): with `make test`'s two xdist workers and work stealing, the long real-CLI
    runs start at once and the many short tests fill the gaps, instead of one long run closing the suite alone."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
