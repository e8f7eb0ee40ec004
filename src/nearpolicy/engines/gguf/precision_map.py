"""Per-tensor precision maps for GGUF export: which GGUF tensors get which weight type.

A map is an ordered sequence of (selector, precision) pairs on top of a default precision; for each tensor the
last matching pair wins. Selectors: "embeddings" (token_embd), "output" (the LM head when it is not tied),
"attention" (every block's attn_* tensors), "mlp" (every block's ffn_* tensors), "blk.N" (block N), "blk.N-M"
(blocks N..M inclusive), or a glob on GGUF tensor names ("blk.3.ffn_*"). 1-D tensors (norms) stay F32 whatever
the map says, as llama.cpp's own quantizer keeps them."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Sequence


KIND_SELECTORS = {
    "embeddings": ("token_embd.*",),
    "output": ("output.*",),
    "attention": ("blk.*.attn_*",),
    "mlp": ("blk.*.ffn_*",),
}
_BLOCKS = re.compile(r"^blk\.(\d+)(?:-(\d+))?$")

PrecisionMap = Sequence[tuple[str, str]]


def validate_selector(selector: str) -> None:
    """Raises ValueError for an unknown selector word or a block range that ends before it starts."""
    if selector in KIND_SELECTORS or "*" in selector or "?" in selector or selector.endswith(".weight"):
        return
    m = _BLOCKS.match(selector)
    if not m:
        raise ValueError(f"unknown tensor selector {selector!r}: use {', '.join(KIND_SELECTORS)}, blk.N, blk.N-M or a "
                         "glob on GGUF tensor names such as 'blk.3.ffn_*'")
    if m.group(2) is not None and int(m.group(2)) < int(m.group(1)):
        raise ValueError(f"block range {selector!r} ends before it starts")


def selector_matches(selector: str, tensor_name: str) -> bool:
    """Whether a selector picks the GGUF tensor `tensor_name` (a block range is compared, never expanded)."""
    validate_selector(selector)
    m = _BLOCKS.match(selector)
    if m:
        block = re.match(r"^blk\.(\d+)\.", tensor_name)
        last = m.group(2) if m.group(2) is not None else m.group(1)
        return block is not None and int(m.group(1)) <= int(block.group(1)) <= int(last)
    globs = KIND_SELECTORS.get(selector, (selector,))
    return any(fnmatch.fnmatchcase(tensor_name, g) for g in globs)


def precision_for(tensor_name: str, default: str, overrides: PrecisionMap) -> str:
    """The precision of one GGUF tensor: the last (selector, precision) pair that matches it, else `default`."""
    chosen = default
    for selector, precision in overrides:
        if selector_matches(selector, tensor_name):
            chosen = precision
    return chosen


def describe(default: str, overrides: PrecisionMap) -> str:
    """Short text of a map: "q4_1" or "q4_1 (blk.3=f16, embeddings=q8_0)"."""
    if not overrides:
        return default
    return f"{default} ({', '.join(f'{s}={p}' for s, p in overrides)})"
