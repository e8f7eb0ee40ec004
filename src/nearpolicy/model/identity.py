"""What a model is, read without loading its weights, and which parts of nearpolicy run it.

`model_facts` reads a resolved `model.path` (model/load.resolve_model) into `ModelFacts`: from a GGUF's header
(metadata only, the tensor data is never touched; `gguf_metadata` skips array contents, so Gemma's 262k-entry
vocabulary costs a fraction of a second) or from an HF folder's config.json / tokenizer_config.json. Architectures
are named as transformers names them (config.json `model_type`): a GGUF's general.architecture is mapped
("gemma3" -> "gemma3_text").

`SUPPORT` is the table of pieces that run only some architectures, each with the config setting that selects it;
`check_support(facts, config)` refuses, at start, a run whose config selects a piece its model's architecture does
not have, and a model.chat_template of "auto" for a model without a chat template.
"""

from __future__ import annotations

import functools
import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from nearpolicy.engines.gguf.architectures import SUPPORTED_MODEL_TYPES as GGUF_MODEL_TYPES
from nearpolicy.model.aligned import ALIGNED_ARCHITECTURES
from nearpolicy.model.templates import CHAT_TEMPLATES, describe_choices

_HF_NAMES = {"gemma3": "gemma3_text"}  # GGUF general.architecture -> transformers model_type, where they differ


# -- the GGUF header ---------------------------------------------------------------------------------------------
class GGUFArray(NamedTuple):
    """An array value of the GGUF metadata, its contents skipped: element type (GGUFValueType) and length."""

    item_type: int
    length: int


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def gguf_metadata(path: Path) -> dict[str, Any]:
    """Every metadata key of the GGUF (version 2 or 3, little-endian) at `path` -> its value (int, float, bool, str;
    an array as a GGUFArray: type and length only). Reads the header alone (memory-mapped). Raises ValueError naming
    the file when it is not a GGUF, its header is truncated or a key appears twice; OSError when it cannot be read."""
    with open(path, "rb") as f:
        try:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                return _read_metadata(m)
        except ValueError as err:  # empty file (mmap), no magic, a version or key the reader refuses
            raise ValueError(f"{path} is not a valid GGUF file: {err}") from None
        except (struct.error, UnicodeDecodeError, OverflowError) as err:  # truncated or garbage header
            raise ValueError(f"{path} is not a valid GGUF file (truncated or corrupt header): {err}") from None


def _read_metadata(m: mmap.mmap) -> dict[str, Any]:
    if m[:4] != b"GGUF":
        raise ValueError("no GGUF magic")
    (version,) = struct.unpack_from("<I", m, 4)
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (2 or 3 expected)")
    _, n_kv = struct.unpack_from("<QQ", m, 8)
    pos, out = 24, {}
    for _ in range(n_kv):
        key, pos = _string(m, pos)
        if key in out:  # llama.cpp refuses such a file; a reader keeping either value would guess
            raise ValueError(f"metadata key {key!r} appears twice")
        (vtype,) = struct.unpack_from("<I", m, pos)
        out[key], pos = _value(m, pos + 4, vtype)
    return out


def _string(m: mmap.mmap, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", m, pos)
    if pos + 8 + n > len(m):
        raise ValueError("a string runs past the end of the file")
    return m[pos + 8: pos + 8 + n].decode("utf-8", errors="replace"), pos + 8 + n


def _value(m: mmap.mmap, pos: int, vtype: int) -> tuple[Any, int]:
    if vtype in _SCALARS:
        return struct.unpack_from(_SCALARS[vtype], m, pos)[0], pos + struct.calcsize(_SCALARS[vtype])
    if vtype == _STRING:
        return _string(m, pos)
    if vtype != _ARRAY:
        raise ValueError(f"unknown metadata value type {vtype}")
    item, n = struct.unpack_from("<IQ", m, pos)
    pos += 12
    if item in _SCALARS:
        pos += n * struct.calcsize(_SCALARS[item])
    else:
        for _ in range(n):  # strings (a vocabulary) or nested arrays: walk each one's length
            pos = _value(m, pos, item)[1] if item != _STRING else pos + 8 + struct.unpack_from("<Q", m, pos)[0]
    if pos > len(m):
        raise ValueError("an array runs past the end of the file")
    return GGUFArray(item, n), pos


# -- facts -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelFacts:
    """What the run derives from the model. `architecture`: transformers' model_type ("llama", "gemma3_text");
    `vocab_size`: rows of the embedding; `chat_template`: the model's own Jinja chat template, None when it has none;
    `bos_token_id` / `eos_token_ids`: as the model declares them; `add_bos`: whether its tokenizer puts BOS before a
    text (None: not declared); `source`: "gguf" or "hf"; `name`: general.name or the folder's name."""

    architecture: str
    vocab_size: int
    chat_template: str | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    add_bos: bool | None
    source: str
    name: str

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)


def model_facts(resolved) -> ModelFacts:
    """The ModelFacts of a ResolvedModel (model/load.resolve_model: kind "gguf" or "hf", path), read without loading
    weights (cached per file version). Raises ValueError naming the file when the GGUF header or config.json lacks
    the architecture or vocabulary size, or cannot be parsed."""
    path = Path(resolved.path)
    st = (path if resolved.kind == "gguf" else path / "config.json").stat()
    return _facts(resolved.kind, str(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _facts(kind: str, path: str, size: int, mtime_ns: int) -> ModelFacts:
    try:
        return _gguf_facts(Path(path)) if kind == "gguf" else _hf_facts(Path(path))
    except (AttributeError, TypeError, UnicodeDecodeError) as err:  # a value of the wrong type in the header / JSON
        raise ValueError(f"{path}: cannot read the model's architecture, vocabulary and template: "
                         f"{type(err).__name__}: {err}") from None


def _gguf_facts(path: Path) -> ModelFacts:
    meta = gguf_metadata(path)
    arch = meta.get("general.architecture")
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = meta.get(f"{arch}.vocab_size") or (tokens.length if isinstance(tokens, GGUFArray) else None)
    if not isinstance(arch, str) or not vocab:
        raise ValueError(f"{path}: the GGUF header names no general.architecture or vocabulary")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return ModelFacts(_HF_NAMES.get(arch, arch), int(vocab), meta.get("tokenizer.chat_template") or None,
                      meta.get("tokenizer.ggml.bos_token_id"), () if eos is None else (int(eos),),
                      meta.get("tokenizer.ggml.add_bos_token"), "gguf", str(meta.get("general.name") or path.stem))


def _hf_facts(folder: Path) -> ModelFacts:
    config = _json(folder / "config.json")
    text = config.get("text_config") or {}  # a multimodal wrapper keeps the language model's values there
    arch, vocab = config.get("model_type"), config.get("vocab_size") or text.get("vocab_size")
    if not isinstance(arch, str) or not isinstance(vocab, int):
        raise ValueError(f"{folder / 'config.json'} names no model_type or vocab_size")
    tokenizer = _json(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").is_file() else {}
    eos = config.get("eos_token_id", text.get("eos_token_id"))
    eos_ids = tuple(eos) if isinstance(eos, list) else () if eos is None else (eos,)
    return ModelFacts(arch, vocab, _hf_template(folder, tokenizer), config.get("bos_token_id"), eos_ids,
                      tokenizer.get("add_bos_token"), "hf", folder.name)


def _hf_template(folder: Path, tokenizer_config: dict) -> str | None:
    """The folder's chat template: chat_template.jinja (transformers >= 4.47 writes it), chat_template.json, or
    tokenizer_config.json's chat_template (a string, or named templates: the "default" one)."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8") or None
    template = tokenizer_config.get("chat_template")
    if (folder / "chat_template.json").is_file():
        template = _json(folder / "chat_template.json").get("chat_template")
    if isinstance(template, list):
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template or None


def _json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} is not a JSON object")
    return value


# -- which pieces run which architectures --------------------------------------------------------------------------
@dataclass(frozen=True)
class Piece:
    """A part of nearpolicy that runs only some architectures: `name` in words, `when` the (config key, value) pairs
    that select it (all must hold), `architectures` the transformers model_type names it runs (None: any causal LM
    transformers loads)."""

    name: str
    when: tuple[tuple[str, Any], ...]
    architectures: frozenset[str] | None

    def selected(self, config) -> bool:
        return all(_setting(config, key) == value for key, value in self.when)

    @property
    def setting(self) -> str:
        """The selecting settings as a config would spell them: "algorithm.precision_alignment = 'engine'"."""
        return " and ".join(f"{key} = {str(value).lower() if isinstance(value, bool) else repr(value)}"
                            for key, value in self.when)


_LLAMA = frozenset({"llama"})  # LoRA: PEFT in the trainer is tested on llama only
SUPPORT: tuple[Piece, ...] = (
    Piece("the llama.cpp engine, its GGUF export and in-place sync", (("engine.kind", "llamacpp"),),
          frozenset(GGUF_MODEL_TYPES)),
    Piece("the hf engine", (("engine.kind", "hf"),), None),
    Piece("the vLLM engine", (("engine.kind", "vllm"),), frozenset({"llama", "gemma3_text"})),
    Piece("the aligned trainer: model/aligned.py emulates llama.cpp's llama graph",
          (("algorithm.precision_alignment", "engine"),), frozenset(ALIGNED_ARCHITECTURES)),
    Piece("LoRA: PEFT adapters in the trainer (tested on llama only) and the GGUF adapter for llama.cpp",
          (("lora.enabled", True),), _LLAMA),
)


def _setting(config, key: str) -> Any:
    return functools.reduce(getattr, key.split("."), config)


def check_same_vocabulary(policy: ModelFacts, teacher: ModelFacts) -> None:
    """Refuse a distillation teacher whose vocabulary size differs from the policy's (per-token KL needs one
    tokenizer; the full tokenizer comparison runs when both load). Raises ValueError naming both sizes."""
    if policy.vocab_size != teacher.vocab_size:
        raise ValueError(f"the teacher {teacher.name} ({teacher.architecture}) has {teacher.vocab_size} tokens in its "
                         f"vocabulary and the policy {policy.name} ({policy.architecture}) {policy.vocab_size}: "
                         "distillation needs the policy's tokenizer")


def check_teacher(policy: ModelFacts, teacher: str) -> None:
    """distill.teacher `teacher` resolves (model/load.resolve_model) to a model of the policy's vocabulary size.
    Raises ValueError starting "distill.teacher" for a missing or unreadable path or another vocabulary size."""
    from nearpolicy.model.load import resolve_model

    try:
        check_same_vocabulary(policy, model_facts(resolve_model(teacher, "distill.teacher")))
    except FileNotFoundError as err:
        raise teacher_error(f"{err} (a teacher is a trained model of the policy's tokenizer, e.g. a run's "
                            "`nearpolicy export RUN_DIR` folder)") from None
    except ValueError as err:
        raise teacher_error(str(err)) from None


def teacher_error(message: str) -> ValueError:
    """A ValueError about distill.teacher: `message` as it is when it names the setting already (resolve_model's and
    the catalog's messages do), else prefixed "distill.teacher: " (a GGUF check or vocabulary message names none)."""
    return ValueError(message if message.startswith("distill.teacher") else f"distill.teacher: {message}")


def check_support(facts: ModelFacts, config) -> None:
    """Refuse, before anything loads, a run whose `config` (a nearpolicy Config) selects a piece of SUPPORT that
    does not run `facts.architecture`, or asks for the model's own chat template (model.chat_template = "auto")
    when it has none. Raises ValueError naming the piece, the config key that selects it and the architecture,
    e.g. "algorithm.precision_alignment = 'engine' (the aligned trainer...) supports llama; model.path
    'gemma3-270m' is gemma3_text"; FileNotFoundError naming model.chat_template when its .jinja file is missing."""
    spec = config.model.path
    for piece in SUPPORT:
        if piece.selected(config) and piece.architectures is not None and facts.architecture not in piece.architectures:
            raise ValueError(f"{piece.setting} ({piece.name}) supports {', '.join(sorted(piece.architectures))}; "
                             f"model.path {spec!r} is {facts.architecture}")
    choice = config.model.chat_template
    if choice == "auto" and not facts.has_chat_template:
        raise ValueError(f"model.chat_template = {choice!r} uses the model's own chat template, and model.path "
                         f"{spec!r} has none; set model.chat_template to 'gemma', 'plain' or a .jinja file")
    if choice not in CHAT_TEMPLATES and not Path(choice).expanduser().is_file():
        raise FileNotFoundError(f"model.chat_template {choice!r} does not exist; {describe_choices()}")
