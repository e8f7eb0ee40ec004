"""Trainer-side log-probs of sampled tokens (fp32, or a bf16 body under trainer_compute; token-in/token-out).

Two ways to run a TokenBatch through the model, equal to float32 rounding:
- padded: every row runs its prompt + completion, right-padded to the batch's longest row;
- shared prompt (the batch has a prompt_group): per group of rows with identical prompt ids, the prompt runs once
  and the completions (all but their last token, which predicts nothing) run at positions P, P+1, ... attending to
  that one prompt: packed into one row with a block mask (no padding), or padded, G rows padded to the group's
  longest on the prompt's key/values repeated G times (the cheaper, batching.packs_completions). A packed group runs
  its prompt in the same forward, [1, P + N], when the prompt is no longer than the N packed tokens (a short prompt's
  own pass runs its products at a fraction of the GEMM rate: docs/bench/update-ceiling.md), else the prompt [1, P]
  first; the padded rows always run on that prompt pass's cache, whose key/values keep their graph. Causal
  attention makes the prompt's hidden states the same in every row, so this is exact, and the gradient of all G
  completions flows back through the one prompt. Source: "Shared-Prompt Flash Attention for Efficient RL Training
  with Large Rollouts and Long Contexts" (DualKV): N(P+R) tokens repacked into P + NR.

The LM head then runs only at the n positions that predict a completion token. Above FULL_LOGITS_BUDGET of [n, V]
logits (Gemma 3's V = 262144: 1 MiB a row) and without top-k / top-p, it runs chunked (ops/chunked_head.py): the
log-prob and entropy come from [R, C] blocks of logits, recomputed in the backward, never the [n, V] tensor.
"""

from __future__ import annotations

import contextlib

import torch

from nearpolicy.batching import TokenBatch, packs_completions
from nearpolicy.ops.chunked_head import chunked_logprobs_and_entropy
from nearpolicy.ops.logprobs import keeps_every_token, token_logprobs_and_entropy
from nearpolicy.ops.observation_loss import raw_logprobs
from nearpolicy.types import SamplingParams

# float32 bytes of the [n, V] logits above which sequence_logprobs runs the chunked head (ops/chunked_head.py): it
# holds [R, C] blocks instead, at the price of recomputing the logits in the backward (one more n x H x V matmul).
# SmolLM2 (V = 49152) at 8 x 130 completion tokens: 200 MiB, unchunked; Gemma 3 (V = 262144): 1 GiB, chunked
# (docs/bench/lm-head.md).
FULL_LOGITS_BUDGET = 256 * 2**20


def sequence_logprobs(model: torch.nn.Module, batch: TokenBatch, sampling: SamplingParams,
                      entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs [B, T] (nats, grad if enabled) of the completion ids under the sampling transform, and the
    entropy [B, T] of that distribution (detached unless `entropy_grad`). Padding positions hold 0 (no logits are
    computed there): mask them. Runs the shared-prompt path when batch.prompt_group is
    set (module docstring), else the padded path; that needs a transformers decoder whose base model takes `cache`,
    `position_ids` and a 4-D additive attention mask (sdpa or eager attention). The LM head runs chunked, never
    holding the [n, V] logits, when they would pass FULL_LOGITS_BUDGET (uses_chunked_head). Raises ValueError for
    a head transform it does not know (head_softcap)."""
    hidden, valid = completion_hidden(model, batch)
    ids = batch.completion_ids[valid]
    with head_in_fp32():
        if uses_chunked_head(model, len(ids), sampling):
            picked, entropy = _chunked(model, hidden, ids, sampling.temperature, entropy_grad)
        else:
            picked, entropy = token_logprobs_and_entropy(
                head_logits(model, hidden), ids, sampling.temperature, sampling.top_k, sampling.top_p, entropy_grad
            )
    return _scatter(picked, valid), _scatter(entropy, valid)


def trainer_compute(precision: str) -> contextlib.AbstractContextManager:
    """The context the trainer's forwards run in (algorithm.trainer_precision; policy_update runs the backward outside
    it, since the chunked head recomputes its logits there): "fp32" none, "bf16"
    torch.autocast on the CPU in bfloat16, so the transformer body's matmuls and attention run in bf16 while the
    weights, their gradients and the residual stream stay fp32; the LM head and log-softmax leave autocast
    (head_in_fp32), since bf16 logits (8 mantissa bits) would move log-probs by about 0.1 nats at |z| ~ 20.
    Raises ValueError for another precision."""
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    raise ValueError(f"unknown trainer precision {precision!r}; valid: fp32, bf16")


def head_in_fp32() -> contextlib.AbstractContextManager:
    """Autocast off: the LM head, log-softmax and entropy run in the head's own dtype (fp32 for the trainer's model)
    whatever the caller's trainer_compute (a no-op under fp32)."""
    return torch.autocast("cpu", enabled=False)


def completion_hidden(model: torch.nn.Module, batch: TokenBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(final hidden states [n, H] in the model's dtype, grad if enabled; valid [B, T] bool): at the n positions that
    predict a completion token (valid: t < the row's completion length), padded or shared-prompt path."""
    hidden = _padded_hidden(model, batch) if batch.prompt_group is None else _shared_hidden(model, batch)
    valid = torch.arange(batch.completion_ids.shape[1]) < batch.completion_lengths[:, None]  # [B, T]
    return hidden[valid], valid


def completion_logits(model: torch.nn.Module, batch: TokenBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw logits [n, V] float32, grad if enabled, valid [B, T] bool): the logits at the n positions that predict
    a completion token (valid: t < the row's completion length), padded or shared-prompt path. The LM head and the
    log-softmax over the vocabulary never run at prompt positions nor at the padding of shorter completions.
    Materialises [n, V]: sequence_logprobs avoids it where it can (uses_chunked_head)."""
    hidden, valid = completion_hidden(model, batch)
    with head_in_fp32():
        return head_logits(model, hidden), valid


def head_softcap(config) -> float | None:
    """The final-logit softcap c of `config` (Gemma 2/3's final_logit_softcapping: z -> c tanh(z / c), applied by
    their ForCausalLM after the LM head), or None. Raises ValueError for the other output-logit transforms
    transformers models apply after their head (Granite's logits_scaling, Cohere's logit_scale), which the trainer's
    head does not reproduce."""
    for key, neutral in (("logits_scaling", 1.0), ("logit_scale", 1.0)):
        value = getattr(config, key, None)
        if value is not None and float(value) != neutral:
            raise ValueError(f"config.{key} = {value}: an output-logit transform model/policy.py does not apply")
    cap = getattr(config, "final_logit_softcapping", None)
    return None if cap is None else float(cap)


def head_logits(model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The logits [n, V] float32 of final hidden states [n, H], as model(...).logits has them: the output embedding,
    then the final-logit softcap where the config sets one (head_softcap, whose ValueError it raises)."""
    cap = head_softcap(model.config)
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)  # a bf16 model keeps its own dtype; under autocast the head stays fp32
    with head_in_fp32():
        logits = head(hidden if weight is None else hidden.to(weight.dtype)).float()
    return logits if cap is None else torch.tanh(logits / cap) * cap


def uses_chunked_head(model: torch.nn.Module, rows: int, sampling: SamplingParams) -> bool:
    """True when sequence_logprobs runs ops/chunked_head.py for `rows` logit rows: their [rows, V] float32 logits
    would pass FULL_LOGITS_BUDGET, the transform keeps every token (no top-k / top-p: the chunked node has no kept
    set) and the output embedding is a plain nn.Linear without hooks (a LoRA-wrapped or quantized head runs its own
    forward, unchunked)."""
    head = model.get_output_embeddings()
    vocab = head.weight.shape[0]
    return (rows * vocab * 4 > FULL_LOGITS_BUDGET and keeps_every_token(sampling.top_k, sampling.top_p, vocab)
            and type(head) is torch.nn.Linear and not (head._forward_hooks or head._forward_pre_hooks))


def _chunked(model: torch.nn.Module, hidden: torch.Tensor, ids: torch.Tensor, temperature: float,
             entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    head = model.get_output_embeddings()
    with head_in_fp32():
        return chunked_logprobs_and_entropy(hidden.to(head.weight.dtype), head.weight, head.bias, ids, temperature,
                                            head_softcap(model.config), entropy_grad)


def _scatter(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """values [n] at the True positions of valid [B, T], 0 elsewhere (differentiable)."""
    return torch.zeros(valid.shape, dtype=values.dtype).masked_scatter(valid, values)


def sequence_logprobs_with_raw(model: torch.nn.Module, batch: TokenBatch, sampling: SamplingParams,
                               entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """sequence_logprobs' (logprobs [B, T], entropy [B, T]) plus the raw log-probs [B, T] (log softmax of the
    untransformed logits, nats, with grad; 0 at padding) of the completion ids from the same forward pass: what
    ECHO's observation loss (ops/observation_loss.py) needs. Under an identity transform (temperature 1, no top-k /
    top-p) the raw log-probs are the logprobs tensor itself; otherwise the chunked head (uses_chunked_head) runs a
    second time at temperature 1. Raises as sequence_logprobs."""
    hidden, valid = completion_hidden(model, batch)
    ids = batch.completion_ids[valid]
    vocab = model.get_output_embeddings().weight.shape[0]
    identity = sampling.temperature == 1.0 and keeps_every_token(sampling.top_k, sampling.top_p, vocab)
    with head_in_fp32():
        if uses_chunked_head(model, len(ids), sampling):
            picked, entropy = _chunked(model, hidden, ids, sampling.temperature, entropy_grad)
            raw = picked if identity else _chunked(model, hidden, ids, 1.0, False)[0]
        else:
            logits = head_logits(model, hidden)
            picked, entropy = token_logprobs_and_entropy(
                logits, ids, sampling.temperature, sampling.top_k, sampling.top_p, entropy_grad
            )
            raw = picked if identity else raw_logprobs(logits, ids)
    return _scatter(picked, valid), _scatter(entropy, valid), _scatter(raw, valid)


def _padded_hidden(model: torch.nn.Module, batch: TokenBatch) -> torch.Tensor:
    """Final hidden states [B, T, H] at batch.logit_positions, every row run in full (right-padded)."""
    hidden = model.base_model(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False
    ).last_hidden_state  # [B, L, H]
    index = batch.logit_positions.unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
    return torch.gather(hidden, 1, index)


def _shared_hidden(model: torch.nn.Module, batch: TokenBatch) -> torch.Tensor:
    """Final hidden states [B, T, H] at batch.logit_positions, each prompt group's prompt run once."""
    parts, order = [], []
    for group in torch.unique(batch.prompt_group):
        rows = (batch.prompt_group == group).nonzero().squeeze(1)
        parts.append(_group_hidden(model, batch, rows))
        order.append(rows)
    return torch.cat(parts)[torch.argsort(torch.cat(order))]


def sliding_window(config) -> int | None:
    """`config`'s sliding attention window (Gemma 3, Mistral: a query attends to keys less than this many positions
    back), None for a model without one."""
    window = getattr(config, "sliding_window", None)
    return None if window is None or getattr(config, "use_sliding_window", True) is False else int(window)


def _group_hidden(model: torch.nn.Module, batch: TokenBatch, rows: torch.Tensor) -> torch.Tensor:
    """Hidden states [G, T, H] of one prompt group's rows (identical prompts of P tokens), the prompt run once: with
    the completions packed after it in one row when P <= the N packed tokens, else first, the completions packed or
    padded on its key/value cache (not detached). Module docstring; batching.packs_completions picks the layout."""
    from transformers import DynamicCache

    n_prompt, lengths = int(batch.prompt_lengths[rows[0]]), batch.completion_lengths[rows]
    steps = (lengths - 1).clamp_min(0)  # tokens each row runs after the prompt: its last token predicts nothing
    prompt, completions = batch.input_ids[rows[:1], :n_prompt], batch.completion_ids[rows]  # [1, P], [G, T]
    n_packed = int(steps.sum())
    packed = n_packed > 0 and packs_completions(steps, n_prompt, model.config.hidden_size, sliding_window(model.config))
    if packed and n_prompt <= n_packed:
        states, starts = _packed(model, prompt, completions, steps)
    else:
        cache = DynamicCache(config=model.config)
        states = model.base_model(input_ids=prompt, cache=cache, use_cache=True).last_hidden_state[0, -1:]  # [1, H]
        starts = torch.zeros(len(rows), dtype=torch.long)
        if n_packed > 0:
            run = _packed_on_cache if packed else _padded_rows
            completion_states, starts = run(model, cache, completions, steps, n_prompt)
            states = torch.cat([states, completion_states])
    # states[0] is the prompt's last position (predicts completion token 0); token t >= 1 of a row is predicted by
    # states[starts + t]; padding reads the prompt's last
    t = torch.arange(batch.completion_ids.shape[1])
    index = torch.where((t >= 1) & (t < lengths[:, None]), starts[:, None] + t, 0)
    return states[index]


def _padded_rows(model, cache, completions: torch.Tensor, steps: torch.Tensor, n_prompt: int):
    """The completions [G, T] as G rows of the longest row's steps S, on the prefix cache repeated G times.
    Returns (hidden [G S, H], [G] index in it, minus 1, of each row's first token)."""
    rows, width = len(steps), int(steps.max())
    cache.batch_repeat_interleave(rows)
    attention = torch.cat([torch.ones((rows, n_prompt), dtype=torch.long),
                           (torch.arange(width) < steps[:, None]).long()], dim=1)
    positions = torch.arange(n_prompt, n_prompt + width).expand(rows, -1)
    out = model.base_model(input_ids=completions[:, :width], attention_mask=attention, position_ids=positions,
                           cache=cache, use_cache=True).last_hidden_state  # [G, S, H]
    return out.reshape(rows * width, -1), torch.arange(rows) * width


def _packed(model, prompt: torch.Tensor, completions: torch.Tensor, steps: torch.Tensor):
    """The prompt [1, P] and the completions [G, T] packed after it into one row of P + N tokens (N = sum(steps)):
    the prompt causal, each completion token attending to the whole prompt and its own row's earlier tokens (a 4-D
    additive mask [1, 1, P + N, P + N]), at positions P + t. Returns (hidden [1 + N, H]: the prompt's last position,
    then the N packed tokens; [G] index among the N of each row's first token)."""
    n_prompt = prompt.shape[1]
    ids, row, starts, t = _packed_layout(completions, steps)
    allowed = torch.zeros((n_prompt + len(ids),) * 2, dtype=torch.bool)
    allowed[:n_prompt, :n_prompt] = torch.ones((n_prompt, n_prompt), dtype=torch.bool).tril()
    allowed[n_prompt:] = _completion_pattern(row, t, n_prompt)
    positions = torch.cat([torch.arange(n_prompt), n_prompt + t])
    mask = _additive(model, allowed)[None, None]
    out = model.base_model(input_ids=torch.cat([prompt[0], ids])[None], attention_mask=mask,
                           position_ids=positions[None], use_cache=False).last_hidden_state[0]  # [P + N, H]
    return out[n_prompt - 1:], starts


def _packed_on_cache(model, cache, completions: torch.Tensor, steps: torch.Tensor, n_prompt: int):
    """The completions [G, T] packed into one row of N = sum(steps) tokens on the prompt's key/value cache, each
    attending to the prompt and its own row's earlier tokens (a 4-D additive mask [1, 1, N, P + N]). Returns (hidden
    [N, H], [G] index in it, minus 1, of each row's first token)."""
    ids, row, starts, t = _packed_layout(completions, steps)
    allowed = _completion_pattern(row, t, n_prompt)
    out = model.base_model(input_ids=ids[None], attention_mask=_additive(model, allowed)[None, None],
                           position_ids=(n_prompt + t)[None], cache=cache, use_cache=True).last_hidden_state[0]
    return out, starts


def _packed_layout(completions: torch.Tensor, steps: torch.Tensor):
    """(ids [N] row by row, each token's row [N], each row's first index [G], each token's position in its row [N])
    of the completions [G, T] packed: each row's first steps[g] tokens."""
    ids = completions[torch.arange(completions.shape[1]) < steps[:, None]]
    row = torch.arange(len(steps)).repeat_interleave(steps)
    starts = torch.cumsum(steps, 0) - steps
    return ids, row, starts, torch.arange(len(ids)) - starts[row]


def _completion_pattern(row: torch.Tensor, t: torch.Tensor, n_prompt: int) -> torch.Tensor:
    """Which keys each of the N packed completion tokens attends to, bool [N, P + N]: every prompt token, and the
    tokens of its own row up to itself (`row`, `t` from _packed_layout)."""
    own = (row[:, None] == row[None, :]) & (t[None, :] <= t[:, None])
    return torch.cat([torch.ones((len(row), n_prompt), dtype=torch.bool), own], dim=1)


def _additive(model, allowed: torch.Tensor) -> torch.Tensor:
    """A boolean attention pattern as the additive mask the model's attention takes (0 where allowed, the dtype's
    lowest elsewhere), in its output embedding's dtype."""
    dtype = model.get_output_embeddings().weight.dtype
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)


@torch.no_grad()
def recompute_logprobs(model: torch.nn.Module, batch: TokenBatch, sampling: SamplingParams, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs [B, T] and entropy [B, T] (float32, no grad) of the batch's completion ids under `model`'s
    current weights, in micro-batches of `micro` rows (old_logprobs when `model` holds the sampling weights)."""
    parts = [sequence_logprobs(model, batch.select(slice(i, i + micro)), sampling) for i in range(0, len(batch), micro)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
