"""GGUF tokenizer metadata written from an HF fast byte-level BPE tokenizer, for exports without a template GGUF
(engines/gguf/export.py)."""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path
from typing import Any

import gguf

# sha256 of str(tokenizer.encode(_PRE_PROBE)) -> llama.cpp pre-tokenizer name (only tokenizers checked here).
_PRE_PROBE = "Hello world! 3.14159 and 1234567 apples\n\n  tabs\tand   spaces; don't I'm 'quoted' ü 中文 🙂 <>[]{}"
_PRE_BY_HASH = {"b1fdb05d831d41a56a8b5db1172f110d737292886d25707967819b504da913c8": "smollm"}  # SmolLM2



def add_tokenizer_metadata(writer: gguf.GGUFWriter, tokenizer: Any, n_vocab: int) -> None:
    """Tokenizer metadata from an HF fast byte-level BPE tokenizer (gguf-py's SpecialVocab for merges / ids)."""
    with tempfile.TemporaryDirectory() as d:
        tokenizer.save_pretrained(d)
        tj_path = Path(d) / "tokenizer.json"
        if not tj_path.is_file():
            raise NotImplementedError("GGUF export without a template needs a fast tokenizer (tokenizer.json)")
        tj = json.loads(tj_path.read_text(encoding="utf-8"))
        model = tj.get("model", {})
        if model.get("type") != "BPE" or (tj.get("decoder") or {}).get("type") != "ByteLevel":
            raise NotImplementedError("GGUF export without a template supports byte-level BPE tokenizers only")
        special = gguf.SpecialVocab(d, load_merges=True, n_vocab=n_vocab)
    id_to_tok = {i: t for t, i in model["vocab"].items()}
    added = {a["id"]: a for a in tj.get("added_tokens", [])}
    for i, a in added.items():
        id_to_tok[i] = a["content"]
    if max(id_to_tok) >= n_vocab:
        raise ValueError(f"tokenizer has ids up to {max(id_to_tok)} but config.vocab_size is {n_vocab}")
    tokens, types = [], []
    for i in range(n_vocab):
        if i not in id_to_tok:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(id_to_tok[i])
            types.append(gguf.TokenType.CONTROL if added[i].get("special") else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(id_to_tok[i])
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_pre_tokenizer_name(tokenizer))
    writer.add_add_space_prefix(False)
    writer.add_token_list(tokens)
    writer.add_token_types([int(t) for t in types])
    special.add_to_gguf(writer, quiet=True)
    probe = tokenizer("a")["input_ids"]
    for key, flag in (
        (gguf.Keys.Tokenizer.ADD_BOS, bool(probe) and probe[0] == tokenizer.bos_token_id),
        (gguf.Keys.Tokenizer.ADD_EOS, bool(probe) and probe[-1] == tokenizer.eos_token_id),
    ):
        if key not in writer.kv_data[0]:
            writer.add_bool(key, flag)


def _pre_tokenizer_name(tokenizer: Any) -> str:
    """llama.cpp pre-tokenizer name, identified by how `tokenizer` splits a probe text (as convert_hf_to_gguf does)."""
    digest = hashlib.sha256(str(tokenizer.encode(_PRE_PROBE, add_special_tokens=False)).encode()).hexdigest()
    name = _PRE_BY_HASH.get(digest)
    if not name:
        raise NotImplementedError(
            f"unknown BPE pre-tokenizer (probe hash {digest[:16]}): llama.cpp would split text differently; "
            "export with template_gguf= a GGUF that has this tokenizer"
        )
    return name
