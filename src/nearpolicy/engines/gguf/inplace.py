"""Weight sync by rewriting the engine's GGUF in place.

llama.cpp maps a GGUF file (load mode "mmap") and its CPU backend, with no extra buffer types, computes straight
from the mapping. New tensor bytes written into the same file at the same offsets are therefore the weights of the
engine's next decode: no new file, no metadata rewrite (about 0.3 s for SmolLM2's 49152-token vocabulary) and no
model reload (about 0.3 s). The first sync writes the whole file (engines/gguf/export.py, atomic); later ones
rewrite its tensors while the file and its tensor layout are unchanged. The engine keeps its model only when it maps
that very file (`RewrittenGGUF.file_id`), and drops every KV cache either way (invariant 9); any other engine
reloads from the path.

The rewrite is not atomic: the file is the engine's copy of the trainer's weights, not a checkpoint (a resumed run
writes it whole again). Only one engine, the in-process one of synchronous training, reads it; asynchronous
replicas load versioned files (rollouts/replicas.py). A K-quant file (engines/gguf/kquant.py) is laid out by
llama.cpp's quantizer, not by this exporter, so every sync at a K-quant writes it whole."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from nearpolicy.engines.base import RewrittenGGUF, file_id
from nearpolicy.engines.gguf.export import convert_state, export_model_report, policy_gguf_name
from nearpolicy.engines.gguf.kquant import KQUANTS
from nearpolicy.engines.gguf.precision_map import PrecisionMap


@dataclass(frozen=True)
class TensorSlot:
    offset: int  # bytes from the start of the file
    nbytes: int
    qtype: gguf.GGMLQuantizationType


Tensors = dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]]


def data_slots(order: list[str], tensors: Tensors, file_size: int,
               alignment: int = gguf.GGUF_DEFAULT_ALIGNMENT) -> dict[str, TensorSlot]:
    """Where gguf-py's writer put each tensor: the data section ends the file, tensors in `order`, each padded to
    `alignment` bytes (gguf_writer.write_tensors_to_file)."""
    padded = [-(-tensors[name][0].nbytes // alignment) * alignment for name in order]
    offset = file_size - sum(padded)
    slots = {}
    for name, size in zip(order, padded):
        array, qtype = tensors[name]
        slots[name] = TensorSlot(offset, array.nbytes, qtype)
        offset += size
    return slots


def holds(path: Path, slots: dict[str, TensorSlot], tensors: Tensors) -> bool:
    """True when the file at `path` holds exactly `tensors`' bytes at `slots` (a check of the computed layout)."""
    with open(path, "rb") as f:
        for name, slot in slots.items():
            f.seek(slot.offset)
            if f.read(slot.nbytes) != memoryview(np.ascontiguousarray(tensors[name][0])).cast("B"):
                return False
    return True


def misfit(slots: dict[str, TensorSlot], tensors: Tensors) -> str | None:
    """Why `tensors` cannot be written over `slots` (other names, or a tensor of another type or size), or None."""
    if set(tensors) != set(slots):
        return "the tensors to rewrite are not the file's tensors"
    for name, (array, qtype) in tensors.items():
        if (array.nbytes, qtype) != (slots[name].nbytes, slots[name].qtype):
            return (f"{name}: {qtype.name}, {array.nbytes} bytes does not fit the file's "
                    f"{slots[name].qtype.name}, {slots[name].nbytes} bytes")
    return None


def rewrite(path: Path, slots: dict[str, TensorSlot], tensors: Tensors) -> None:
    """Write `tensors` over their `slots` in the file at `path`. Raises ValueError (`misfit`'s reason), before writing
    anything, when they do not fit; OSError from the writes."""
    if reason := misfit(slots, tensors):
        raise ValueError(reason)
    fd = os.open(path, os.O_WRONLY)
    try:
        for name, (array, _) in tensors.items():
            view = memoryview(np.ascontiguousarray(array)).cast("B")
            offset = slots[name].offset
            while view:  # pwrite may write less than asked
                written = os.pwrite(fd, view, offset)
                view, offset = view[written:], offset + written
    finally:
        os.close(fd)


class EngineGGUF:
    """The in-process engine's GGUF, `folder`/policy-<precision>.gguf, kept at `model`'s current weights: calling it
    writes the file whole (first call, or when the file or its layout changed) and returns its Path, or rewrites its
    tensors in place and returns a RewrittenGGUF. Arguments as engines/gguf/export.export_model_gguf. Raises what
    export_gguf raises; OSError naming the file and its state when a write fails (a whole write is atomic; after a
    failed rewrite the next call writes the file whole)."""

    def __init__(self, model: torch.nn.Module, folder: Path, precision: str, tensor_precision: PrecisionMap,
                 template_gguf: Path | None, tokenizer: Any, rounding: str = "nearest", seed: int = 0,
                 log: Callable[[str], None] = print):
        self.model, self.path = model, Path(folder) / policy_gguf_name(precision)
        self.precision, self.tensor_precision = precision, tuple(tensor_precision)
        self.template_gguf, self.tokenizer, self.rounding, self.seed, self.log = (
            template_gguf, tokenizer, rounding, seed, log)
        self.slots: dict[str, TensorSlot] | None = None
        self.file_id: tuple[int, int] | None = None
        self.in_place = precision not in KQUANTS  # off for good once a computed layout failed its check

    def __call__(self) -> Path | RewrittenGGUF:
        state = {k: v.detach() for k, v in self.model.state_dict().items()}
        if not self.in_place or self.slots is None or not self.path.is_file() or file_id(self.path) != self.file_id:
            return self._write_whole(state)
        tensors = self._convert(state)
        if misfit(self.slots, tensors):
            return self._write_whole(state)
        try:
            rewrite(self.path, self.slots, tensors)
        except BaseException as err:
            self.slots = None  # half-written: the next sync writes the file whole
            if isinstance(err, OSError):
                raise OSError(err.errno, f"could not write the engine GGUF {self.path} ({err.strerror or err}); "
                                         f"{self.path.name} is partly rewritten (the next weight sync writes it "
                                         "whole)") from err
            raise
        return RewrittenGGUF(str(self.path), self.file_id)

    def _convert(self, state: dict) -> Tensors:
        return {name: (array, qtype) for name, array, qtype in convert_state(
            state, self.model.config, self.precision, None, self.tensor_precision, self.rounding, self.seed)}

    def _write_whole(self, state: dict) -> Path:
        self.slots = None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        report = export_model_report(self.model, self.path, self.precision, self.tensor_precision, self.template_gguf,
                                     self.tokenizer, self.rounding, self.seed)
        if self.in_place:  # the layout of the file just written, checked against its bytes (a second conversion)
            tensors = self._convert(state)
            slots = data_slots(list(report.tensor_types), tensors, report.bytes)
            if holds(self.path, slots, tensors):
                self.slots, self.file_id = slots, file_id(self.path)
            else:
                self.in_place = False
                self.log(f"nearpolicy: {self.path.name} does not have the expected tensor layout; every weight sync "
                         "writes it whole")
        return self.path
