"""Token identity for `diagnose --endpoint`: the sampled ids of a text-only server recovered from its token strings,
the tokenizer check, and the re-tokenization drift a text round trip would cause (docs/diagnose.md).

- **Ids from token strings.** A server that returns token strings only (llama-cpp-python's) is mapped string by
  string through the reference tokenizer's vocabulary: each id decoded alone; strings that several ids share, empty
  strings (special tokens, which llama.cpp renders as "") and partial UTF-8 characters map to nothing. A completion
  with an unmapped string is left out of the measurement and counted; it is never re-tokenized silently.
- **Tokenizer check.** With ids in hand, the reference tokenizer's decoding of them must reproduce the server's
  text; for a text-only server, most of its token strings must be in the reference vocabulary.
- **Re-tokenization drift.** What a text-in/text-out client (decode the completion, encode it again) would hand
  the trainer: the re-encoded ids against the sampled ones, per completion. Reported in its own row, never mixed
  into k1 / k3.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nearpolicy.diagnosis.endpoint_client import EndpointError, EndpointSample

TOKENIZER_AGREEMENT_MIN = 0.5  # below this fraction of agreeing completions / known strings: a different tokenizer


@dataclass
class ResolvedSample:
    """A sample with ids: `completion_ids` [T] (None when they could not be recovered), `top_ids` [T] of {id:
    log-prob} (entries whose string did not map dropped) and how many listed entries were dropped."""

    sample: EndpointSample
    completion_ids: list[int] | None
    top_ids: list[dict[int, float]]
    dropped_entries: int = 0


@dataclass
class TokenIdentity:
    """How ids were obtained and what the checks found (JSON-ready counts)."""

    ids_from: str  # "server ids" or "token strings"
    prompt_sent_as: str  # "ids" or "text"
    completions: int = 0
    unmapped_completions: int = 0
    dropped_top_entries: int = 0
    text_disagreements: int = 0
    details: dict = field(default_factory=dict)


def piece_index(tokenizer) -> dict[str, int]:
    """Token string -> id over the vocabulary, for strings exactly one id decodes to (no empty strings, no partial
    UTF-8 characters)."""
    seen: dict[str, int] = {}
    shared: set[str] = set()
    for i in range(len(tokenizer)):
        piece = tokenizer.decode([i], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if not piece or "\ufffd" in piece:
            continue
        if piece in seen:
            shared.add(piece)
        seen[piece] = i
    return {p: i for p, i in seen.items() if p not in shared}


def resolve(samples: list[EndpointSample], tokenizer, stop_ids: set[int]) -> tuple[list[ResolvedSample], TokenIdentity]:
    """Ids of every sample (module docstring) and the tokenizer check. Raises EndpointError (cause "tokenizer")
    when the server's tokens disagree with the reference tokenizer on most completions or strings, or a sampled or
    listed id lies outside its vocabulary."""
    text_only = any(s.completion_ids is None for s in samples)
    identity = TokenIdentity("token strings" if text_only else "server ids", samples[0].prompt_sent_as if samples else "ids",
                             completions=len(samples))
    index = piece_index(tokenizer) if text_only or any(isinstance(k, str) for s in samples for t in s.top for k in t) \
        else {}
    resolved, known, total = [], 0, 0
    for s in samples:
        ids = s.completion_ids
        if ids is None:
            mapped = [index.get(p) for p in s.pieces]
            known += sum(m is not None for m in mapped)
            total += len(mapped)
            ids = None if any(m is None for m in mapped) else mapped
            identity.unmapped_completions += ids is None
        elif not _text_agrees(tokenizer, ids, s.text, stop_ids):
            identity.text_disagreements += 1
        tops, dropped = _top_ids(s.top, index)
        identity.dropped_top_entries += dropped
        resolved.append(ResolvedSample(s, ids, tops, dropped))
    _check_tokenizer(identity, known, total, len(tokenizer))
    for r in resolved:  # ids the client accepted (0 <= id < endpoint_client.MAX_TOKEN_ID) but this vocabulary lacks
        listed = [i for row in r.top_ids for i in row]
        if any(not 0 <= t < len(tokenizer) for t in [*(r.completion_ids or []), *listed]):
            raise EndpointError("tokenizer", f"the server returned token ids outside the reference vocabulary "
                                             f"[0, {len(tokenizer)}): a different tokenizer")
    return resolved, identity


def _check_tokenizer(identity: TokenIdentity, known: int, total: int, vocab: int) -> None:
    if total and known / total < TOKENIZER_AGREEMENT_MIN:
        raise EndpointError("tokenizer", f"only {known} of {total} token strings the server returned are in the "
                                         f"reference tokenizer's vocabulary ({vocab} ids): a different tokenizer")
    checked = identity.completions - identity.unmapped_completions if identity.ids_from == "server ids" else 0
    if checked and identity.text_disagreements > (1 - TOKENIZER_AGREEMENT_MIN) * checked:
        raise EndpointError("tokenizer", f"{identity.text_disagreements} of {checked} completions: the reference "
                                         "tokenizer's decoding of the server's token ids is not the server's text "
                                         "(a different tokenizer, or a server that rewrites its output)")


def _top_ids(tops: list[dict], index: dict[str, int]) -> tuple[list[dict[int, float]], int]:
    out, dropped = [], 0
    for top in tops:
        row = {}
        for key, value in top.items():
            i = key if isinstance(key, int) else index.get(key)
            if i is None:
                dropped += 1
            else:
                row[i] = value
        out.append(row)
    return out, dropped


def _clean(text: str) -> str:
    return text.replace("\ufffd", "")


def _text_agrees(tokenizer, ids: list[int], text: str, stop_ids: set[int]) -> bool:
    """The decoding of `ids` is the server's text, with or without a final stop token's string (servers differ on
    whether they print it) and up to partial UTF-8 characters at the end."""
    body = ids[:-1] if ids and ids[-1] in stop_ids else ids
    variants = {tokenizer.decode(v, skip_special_tokens=False, clean_up_tokenization_spaces=False)
                for v in (ids, body)}
    return _clean(text) in {_clean(v) for v in variants}


def retokenize(tokenizer, resolved: list[ResolvedSample], stop_ids: set[int]) -> list[tuple[int, list[int], list[int]]]:
    """For each completion whose ids are known: (sample position, the sampled ids without a final stop token, the
    ids the reference tokenizer encodes their decoded text to); only completions where the two differ."""
    out = []
    for n, r in enumerate(resolved):
        ids = r.completion_ids
        if ids is None:
            continue
        body = ids[:-1] if ids and ids[-1] in stop_ids else list(ids)
        text = tokenizer.decode(body, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        again = tokenizer(text, add_special_tokens=False)["input_ids"]
        if list(again) != body:
            out.append((n, body, list(again)))
    return out
