"""Export trainer weights (an HF state dict) to a GGUF that llama.cpp loads, for the architectures of
engines/gguf/architectures.py (llama, gemma3_text), chosen by the config's model_type.

Metadata: the tokenizer / general fields come from a template GGUF of the same architecture (copied byte for
byte) or, without one, from the HF tokenizer; the `{arch}.*` keys and `general.file_type` always come from the HF
config. Tensors: HF names mapped with gguf-py's TensorNameMap for the architecture; values transformed as
llama.cpp's convert_hf_to_gguf.py does (llama: q / k rows permuted; gemma3: norms stored as 1 + w), which
transformers undoes on GGUF load; 2-D weights quantized with gguf-py in numpy, 1-D tensors kept F32. Writes are
atomic (temp file in the same folder, fsync, os.replace) and deterministic. A K-quant precision (KQUANTS: q4_k_m ...)
is an f32 export quantized by llama.cpp's own quantizer in a child process (engines/gguf/kquant.py).
"""

from __future__ import annotations

import functools
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import gguf
import numpy as np
import torch

from nearpolicy.engines.gguf.architectures import ArchSpec, arch_spec, permute
from nearpolicy.engines.gguf.kquant import KQUANTS, SOURCE_PRECISION, llama_quantize, scratch_path
from nearpolicy.engines.gguf.rounding import check_rounding, rounding_input
from nearpolicy.engines.gguf.quantize import quantize
from nearpolicy.engines.gguf.tokenizer import add_tokenizer_metadata
from nearpolicy.engines.gguf.precision_map import PrecisionMap, precision_for, selector_matches, validate_selector
from nearpolicy.files import atomic_path

_Q = gguf.GGMLQuantizationType
_F = gguf.LlamaFileType
QTYPES: dict[str, tuple[gguf.GGMLQuantizationType, gguf.LlamaFileType]] = {
    "f32": (_Q.F32, _F.ALL_F32),
    "f16": (_Q.F16, _F.MOSTLY_F16),
    "bf16": (_Q.BF16, _F.MOSTLY_BF16),
    "q8_0": (_Q.Q8_0, _F.MOSTLY_Q8_0),
    "q5_0": (_Q.Q5_0, _F.MOSTLY_Q5_0),
    "q4_0": (_Q.Q4_0, _F.MOSTLY_Q4_0),
    "q4_1": (_Q.Q4_1, _F.MOSTLY_Q4_1),
    "mxfp4": (_Q.MXFP4, _F.MOSTLY_MXFP4_MOE),
}
TENSOR_PRECISIONS: tuple[str, ...] = tuple(QTYPES)  # gguf-py's types: per tensor, in-place sync, weights_only
PRECISIONS: tuple[str, ...] = TENSOR_PRECISIONS + tuple(KQUANTS)  # + llama.cpp's K-quant mixes (engines/gguf/kquant.py)

_EMBEDDING = ("token_embd.weight", "output.weight")
_permute = permute  # llama's q / k permutation under its old name here (tests import it)
# Template fields not copied: virtual reader fields (GGUF.), ones GGUFWriter writes, and ones derived from the
# config (every `{arch}.` key).
_SKIP_KEYS = {"general.architecture", "general.file_type", "general.quantization_version", "general.alignment"}

@dataclass
class ExportReport:
    """What `export_gguf` wrote: GGUF tensor name -> GGML type name, F16 fallbacks, file size (bytes), seconds."""

    path: Path
    precision: str
    tensor_types: dict[str, str] = field(default_factory=dict)
    fallback_f16: list[str] = field(default_factory=list)
    bytes: int = 0
    seconds: float = 0.0


def export_gguf(
    state_dict: dict[str, torch.Tensor],
    config: Any,
    out_path: Path,
    precision: str,
    template_gguf: Path | None,
    tokenizer: Any = None,
    embedding_precision: str | None = None,
    tensor_precision: PrecisionMap = (),
    rounding: str = "nearest",
    rounding_seed: int = 0,
) -> ExportReport:
    """Write `state_dict` (HF names, any float dtype, [out, in] weights) as a GGUF at `precision`.

    `config` is the HF config (model_type llama or gemma3_text: engines/gguf/architectures.py); `template_gguf` a
    GGUF of the same architecture whose general.* / tokenizer.* fields (and tensor
    order, when it has the same tensors) are copied; without one, `tokenizer` (an HF fast byte-level BPE tokenizer)
    provides the tokenizer metadata. Re-exporting a GGUF's own dequantized weights at its own types reproduces it
    byte for byte. `embedding_precision` (default: `precision`) applies to token_embd / output, e.g. "q8_0" with
    "q4_1" as llama.cpp's quantizer does. `tensor_precision` (selector, precision) pairs override both per tensor
    (engines/gguf/precision_map.py). `rounding`: "nearest" or "stochastic" with `rounding_seed` (engines/gguf/rounding.py).
    A K-quant `precision` (KQUANTS) is exported at f32 to a scratch file and quantized by llama.cpp
    (engines/gguf/kquant.py); it takes no embedding precision, per-tensor overrides or stochastic rounding.
    Raises ValueError (unsupported model_type, unknown precision or rounding, unknown tensor name, a template of
    another architecture, an option a K-quant does not take), NotImplementedError (rope scaling or another config
    feature llama.cpp would compute differently, a tokenizer this exporter cannot describe), kquant.QuantizeError
    (llama.cpp's quantizer failed or crashed); on any error `out_path` is left untouched.
    """
    out_path = Path(out_path)
    start = time.perf_counter()
    check_precisions(precision, embedding_precision, tensor_precision, rounding)
    if precision in KQUANTS:
        return _export_kquant(state_dict, config, out_path, precision, template_gguf, tokenizer, start)
    writer, tensor_order = _metadata_writer(config, QTYPES[precision][1], template_gguf, tokenizer)
    report = ExportReport(path=out_path, precision=precision)
    for name, array, raw_dtype in convert_state(state_dict, config, precision, embedding_precision, tensor_precision,
                                                rounding, rounding_seed, tensor_order, report):
        writer.add_tensor(name, array, raw_dtype=raw_dtype)
    _write_atomically(writer, out_path)
    report.bytes = out_path.stat().st_size
    report.seconds = time.perf_counter() - start
    return report


def check_precisions(precision: str, embedding_precision: str | None, tensor_precision: PrecisionMap,
                     rounding: str) -> None:
    """Raise ValueError for an unknown precision, an invalid tensor selector, a rounding the precisions reject, or a
    K-quant with an embedding precision or per-tensor overrides (or named as one)."""
    if precision in KQUANTS:
        if (embedding_precision or precision) != precision or tensor_precision:
            raise ValueError(f"GGUF precision {precision!r} is llama.cpp's own per-tensor mix "
                             "(engines/gguf/kquant.py): it takes no embedding precision or per-tensor overrides")
        check_rounding(rounding, {precision})
        return
    for p in (embedding_precision or precision, *(p for _, p in tensor_precision)):
        if p in KQUANTS:
            raise ValueError(f"{p!r} is a whole-file llama.cpp quantization, not a per-tensor type; per-tensor "
                             f"types: {', '.join(TENSOR_PRECISIONS)}")
    for p in (precision, embedding_precision or precision, *(p for _, p in tensor_precision)):
        if p not in QTYPES:
            raise ValueError(f"unknown GGUF precision {p!r}; valid: {', '.join(PRECISIONS)}")
    check_rounding(rounding, {precision, embedding_precision or precision, *(p for _, p in tensor_precision)})
    for selector, _ in tensor_precision:
        validate_selector(selector)  # an unknown selector fails before anything is written


def convert_state(state_dict: dict[str, torch.Tensor], config: Any, precision: str, embedding_precision: str | None,
                  tensor_precision: PrecisionMap, rounding: str, rounding_seed: int, tensor_order: tuple[str, ...] = (),
                  report: ExportReport | None = None) -> list[tuple[str, np.ndarray, gguf.GGMLQuantizationType]]:
    """(GGUF name, stored array, GGML type) per tensor of `state_dict`, exactly as `export_gguf` writes them (in
    `tensor_order` when it names the same tensors); fills `report`'s tensor types. Raises ValueError as
    `export_gguf` does, including for a tensor selector that matches no tensor."""
    report = report or ExportReport(path=Path(), precision=precision)

    def qtype_of(name: str) -> gguf.GGMLQuantizationType:
        default = (embedding_precision or precision) if name in _EMBEDDING else precision
        return QTYPES[precision_for(name, default, tensor_precision)][0]

    def gridded(w: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:  # what gguf-py rounds to nearest
        return rounding_input(w, qtype.name.lower(), rounding, rounding_seed)

    tensors = _convert_tensors(state_dict, config, qtype_of, gridded, tensor_order, report)
    for selector, _ in tensor_precision:  # a selector that picks nothing is a typo or the wrong model
        if not any(selector_matches(selector, name) for name in report.tensor_types):
            raise ValueError(f"tensor selector {selector!r} matches no tensor of this model ({config.num_hidden_layers} "
                             f"blocks, blk.0-{config.num_hidden_layers - 1}"
                             f"{'; the output head is tied to the embeddings' if 'output.weight' not in report.tensor_types else ''})")
    return tensors


def _export_kquant(state_dict: dict[str, torch.Tensor], config: Any, out_path: Path, precision: str,
                   template_gguf: Path | None, tokenizer: Any, start: float) -> ExportReport:
    """`export_gguf` at a K-quant: the state at SOURCE_PRECISION to a scratch file beside `out_path` (not fsynced:
    it is deleted), then llama.cpp's quantizer into `out_path` (atomic). fallback_f16 lists the tensors llama.cpp
    stored at F16."""
    writer, tensor_order = _metadata_writer(config, QTYPES[SOURCE_PRECISION][1], template_gguf, tokenizer)
    for name, array, raw_dtype in convert_state(state_dict, config, SOURCE_PRECISION, None, (), "nearest", 0,
                                                tensor_order):
        writer.add_tensor(name, array, raw_dtype=raw_dtype)
    with scratch_path(out_path) as source:
        _write_atomically(writer, source, durable=False)
        types = llama_quantize(source, out_path, precision)
    return ExportReport(path=out_path, precision=precision, tensor_types=types,
                        fallback_f16=[n for n, t in types.items() if t == "F16"], bytes=out_path.stat().st_size,
                        seconds=time.perf_counter() - start)


def policy_gguf_name(precision: str) -> str:
    """The file name of the policy's GGUF at `precision` in an engine or export folder."""
    return f"policy-{precision}.gguf"


def export_model_gguf(model: torch.nn.Module, folder: Path, precision: str, tensor_precision: PrecisionMap,
                      template_gguf: Path | None, tokenizer: Any, rounding: str = "nearest", seed: int = 0) -> Path:
    """Write `model`'s current weights as `folder`/policy-<precision>.gguf (`export_model_report`) and return its
    path."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / policy_gguf_name(precision)
    return export_model_report(model, path, precision, tensor_precision, template_gguf, tokenizer, rounding, seed).path


def export_model_report(model: torch.nn.Module, path: Path, precision: str, tensor_precision: PrecisionMap,
                        template_gguf: Path | None, tokenizer: Any, rounding: str = "nearest",
                        seed: int = 0) -> ExportReport:
    """Write `model`'s current weights to `path` (`export_gguf` with `tensor_precision` overrides, `rounding` seeded
    by `seed`). Raises OSError naming the file when it cannot be written (the file an engine holds is untouched:
    the write is atomic), else what `export_gguf` raises."""
    state = {k: v.detach() for k, v in model.state_dict().items()}
    try:
        return export_gguf(state, model.config, path, precision, template_gguf, tokenizer=tokenizer,
                           tensor_precision=tuple(tensor_precision), rounding=rounding, rounding_seed=seed)
    except OSError as err:
        kept = f"the previous {path.name} is unchanged" if path.exists() else f"{path.name} was not created"
        raise OSError(err.errno, f"could not write the engine GGUF {path} ({err.strerror or err}); {kept}") from err


def export_vocab_gguf(config: Any, out_path: Path, template_gguf: Path | None, tokenizer: Any = None) -> Path:
    """Write a GGUF holding only the metadata `export_gguf` would write (no tensors): enough for llama.cpp to load
    the vocabulary (`vocab_only`), e.g. to read its end-of-generation set. Raises as `export_gguf`."""
    writer, _ = _metadata_writer(config, QTYPES["f32"][1], template_gguf, tokenizer)
    _write_atomically(writer, Path(out_path))
    return Path(out_path)


def _metadata_writer(config: Any, ftype: gguf.LlamaFileType, template_gguf: Path | None,
                     tokenizer: Any) -> tuple[gguf.GGUFWriter, tuple[str, ...]]:
    """A GGUFWriter holding the metadata (template or tokenizer fields, arch keys from `config`) and the
    template's tensor order (empty without a template)."""
    spec = arch_spec(config)
    writer = gguf.GGUFWriter(path=None, arch=spec.name)
    arch_kv = _arch_metadata(spec, config, ftype)
    tensor_order: tuple[str, ...] = ()
    if template_gguf is not None:
        template = Path(template_gguf)
        st = template.stat()
        fields, tensor_order = _template_fields(str(template.resolve()), st.st_size, st.st_mtime_ns, spec.name)
        skip_prefixes = ("GGUF.", f"{spec.name}.")
        n_tokens = next((len(value) for key, value, _, _ in fields if key == "tokenizer.ggml.tokens"), None)
        if n_tokens is not None and n_tokens != config.vocab_size:  # llama.cpp would refuse the file, unexplained
            raise ValueError(f"template {template} has {n_tokens} tokens; the model's vocab_size is "
                             f"{config.vocab_size}")
        for key, value, vtype, sub_type in fields:  # template order; arch keys take their template slot
            if key in arch_kv:
                v = arch_kv.pop(key)
                writer.add_key_value(key, v.value, v.type)
            elif not (key in _SKIP_KEYS or key.startswith(skip_prefixes)):
                writer.add_key_value(key, value, vtype, sub_type=sub_type)
    elif tokenizer is not None:
        add_tokenizer_metadata(writer, tokenizer, config.vocab_size)
    else:
        raise ValueError("export_gguf needs template_gguf or an HF tokenizer for the tokenizer metadata")
    for key, v in arch_kv.items():
        writer.add_key_value(key, v.value, v.type)
    return writer, tensor_order


def _write_atomically(writer: gguf.GGUFWriter, out_path: Path, durable: bool = True) -> None:
    """Header, metadata and tensors to a temp file beside `out_path`, fsynced (`durable`), then renamed over it."""
    try:
        with atomic_path(out_path, durable=durable) as tmp:
            writer.write_header_to_file(tmp)
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
            writer.close()
    finally:
        writer.close()  # closing twice is harmless; an error above must not leave the file open


def tensor_precision(hf_name: str, config: Any, precision: str, overrides: PrecisionMap = (),
                     embedding_precision: str | None = None) -> str:
    """The GGUF type `export_gguf` stores the HF tensor `hf_name` at (2-D weights; 1-D tensors stay F32). Raises
    ValueError for an unsupported model_type or a name the architecture's map does not know."""
    _, name = arch_spec(config).gguf_tensor(hf_name, config.num_hidden_layers)
    default = (embedding_precision or precision) if name in _EMBEDDING else precision
    return precision_for(name, default, overrides)


def _canonical_order(name: str) -> tuple[int, str]:
    m = re.match(r"blk\.(\d+)\.", name)
    if m:
        return 1 + int(m.group(1)), name
    return (0, name) if name.startswith("token_embd") else (1 << 30, name)


def _convert_tensors(
    state_dict: dict[str, torch.Tensor],
    config: Any,
    qtype_of: Callable[[str], gguf.GGMLQuantizationType],
    gridded: Callable[[np.ndarray, gguf.GGMLQuantizationType], np.ndarray],
    template_order: tuple[str, ...],
    report: ExportReport,
) -> list[tuple[str, np.ndarray, gguf.GGMLQuantizationType]]:
    """(GGUF name, array, GGML type) per tensor, in the template's tensor order when it has the same tensors,
    else token_embd, blocks, output; fills report.tensor_types / fallback_f16."""
    spec = arch_spec(config)
    out: list[tuple[str, np.ndarray, gguf.GGMLQuantizationType]] = []
    for hf_name, tensor in state_dict.items():
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue
        if hf_name == "lm_head.weight" and getattr(config, "tie_word_embeddings", False):
            continue
        kind, name = spec.gguf_tensor(hf_name, config.num_hidden_layers)
        w = np.ascontiguousarray(tensor.detach().to("cpu", torch.float32).numpy())
        t = qtype_of(name) if w.ndim >= 2 else _Q.F32
        if w.shape[-1] % gguf.GGML_QUANT_SIZES[t][0] != 0:
            t = _Q.F16
            report.fallback_f16.append(name)
        w = gridded(w, t)  # in the trainer's layout (model/aligned.py rounds the same array); rows: permutation-safe
        w = np.ascontiguousarray(spec.to_gguf(w, kind, config), dtype=np.float32)
        out.append((name, quantize(w, t), t))
        report.tensor_types[name] = t.name
    if sorted(template_order) == sorted(n for n, _, _ in out):
        rank = {n: i for i, n in enumerate(template_order)}
        out.sort(key=lambda item: rank[item[0]])
    else:
        out.sort(key=lambda item: _canonical_order(item[0]))
    report.tensor_types = {n: report.tensor_types[n] for n, _, _ in out}
    return out


def _arch_metadata(spec: ArchSpec, config: Any, ftype: gguf.LlamaFileType) -> dict[str, Any]:
    """key -> GGUFValue: `{arch}.*` hyper-parameters from the HF config, file type and quantization version."""
    writer = gguf.GGUFWriter(path=None, arch=spec.name)  # scratch: its typed add_* helpers name and type the keys
    spec.add_keys(writer, config)
    writer.add_file_type(int(ftype))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    return {k: v for k, v in writer.kv_data[0].items() if k != "general.architecture"}


@functools.lru_cache(maxsize=4)
def _template_fields(path: str, size: int, mtime_ns: int,
                     arch: str) -> tuple[tuple[tuple[Any, ...], ...], tuple[str, ...]]:
    """((key, value, type, sub_type) per field, tensor names), in file order; strings kept as raw bytes. Raises
    ValueError when the template's general.architecture is not `arch`.

    Cached per file version (size, mtime): parsing SmolLM2's 49152 tokens and 48900 merges takes about 3.5 s.
    """
    reader = gguf.GGUFReader(path)
    field = reader.fields.get("general.architecture")
    found = field.contents() if field is not None else None
    if found != arch:
        raise ValueError(f"template {path} is a {found} GGUF; this model's architecture is {arch}")
    fields = []
    for f in reader.fields.values():
        if f.name.startswith("GGUF."):
            continue
        vtype = f.types[0]
        sub_type = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        if vtype == gguf.GGUFValueType.STRING:
            value: Any = bytes(f.parts[-1])
        elif sub_type == gguf.GGUFValueType.STRING:
            value = [bytes(f.parts[i]) for i in f.data]
        else:
            value = f.contents()
        fields.append((f.name, value, vtype, sub_type))
    return tuple(fields), tuple(t.name for t in reader.tensors)


def round_to_precision(weight: np.ndarray, precision: str) -> np.ndarray:
    """Quantize a float32 [out, in] weight to `precision` and dequantize it back (float32, same shape): the
    weight-rounding error of that type without its kernels. Rows whose length is not a multiple of the type's
    block size are returned unchanged (the exporter stores those at F16). Raises ValueError for a K-quant (llama.cpp
    picks its types per tensor of the whole file) or an unknown precision."""
    if precision not in QTYPES:
        raise ValueError(f"cannot round one tensor to {precision!r}: per-tensor types are "
                         f"{', '.join(TENSOR_PRECISIONS)}")
    qtype = QTYPES[precision][0]
    if weight.ndim < 2 or weight.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0] != 0:
        return weight
    packed = quantize(np.ascontiguousarray(weight, dtype=np.float32), qtype)
    return gguf.quants.dequantize(packed, qtype).reshape(weight.shape).astype(np.float32)
