"""The LM head and the fused log-prob / entropy of ops/fused_logprobs.py in one autograd node that never holds the
[n, V] logits: blocks of [R, C] logits (R rows, C vocabulary columns) are made, reduced to per-row scalars and
dropped, in the forward and again in the backward, so memory is O(R C) instead of O(n V) (about 1 GiB for
8 x 130 rows at Gemma 3's V = 262144, plus as much again for their gradient and each vocabulary-wide temporary).

For rows h [n, H], head weight W [V, H] (tied or not), bias b [V] or None, optional softcap c (Gemma's
final_logit_softcapping) and temperature T:

    z = h W^T + b,   z <- c tanh(z / c) if c,   s = z / T
    per column chunk k:  l_k = logsumexp(s_k),  H_k = -sum_j p_kj log p_kj  (p_k = softmax(s_k), within the chunk)
    lse = logsumexp_k(l_k),  w_k = exp(l_k - lse)  (the chunk's share of the probability)
    log pi(y) = s_y - lse,   H = sum_k w_k (H_k - log w_k)     (every term >= 0: no cancellation)

The backward recomputes each block's logits (one extra h W^T, the price of the memory; at Gemma 3's size it costs
about what the unchunked path's passes over [n, V] buffers cost, docs/bench/lm-head.md) and applies the fused node's
gradient, d/ds_j = gL ([j = y] - p_j) - gH p_j (log p_j + H), then d/dz = (d/ds) / T (times 1 - tanh^2 under a
softcap), d/dh = (d/dz) W, d/dW = (d/dz)^T h, d/db = column sums. The vocabulary is split into C-column chunks and
the rows into R-row blocks so the head's weight is read once per row block (chunking rows alone re-reads the
whole [V, H] weight per chunk: 64-row chunks took twice the time of one [1040, 640] x [640, 262144] matmul).
Equal to the unchunked head + fused node to float32 rounding (tests/test_chunked_head.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nearpolicy.ops.fused_logprobs import LOGP_FLOOR

BLOCK_BYTES = 32 * 2**20  # float32 bytes of one [R, C] logits block; a block lives with about two more of its size
MAX_ROWS = 2048  # rows of a block: the weight is read ceil(n / MAX_ROWS) times per pass
MIN_COLUMNS = 1024


def block_shape(rows: int, vocab: int, block_bytes: int | None = None) -> tuple[int, int]:
    """(R, C): rows per block and vocabulary columns per chunk for n = `rows` rows of a `vocab`-wide head, R x C x 4
    bytes <= block_bytes (None: BLOCK_BYTES) where C >= MIN_COLUMNS allows (C a multiple of 256, at most vocab)."""
    block_bytes = BLOCK_BYTES if block_bytes is None else block_bytes
    r = max(1, min(rows, MAX_ROWS, block_bytes // (4 * MIN_COLUMNS)))
    c = max(MIN_COLUMNS, (block_bytes // (4 * r)) // 256 * 256)
    return r, min(c, vocab)


def _block_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cols: slice,
                  softcap: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(z [R, C] after the softcap, float32 (float64 for a float64 head), tanh(z_raw / c) [R, C] or None without a
    softcap)."""
    z = F.linear(h, weight[cols], None if bias is None else bias[cols]).to(_exact(weight))
    if softcap is None:
        return z, None
    t = z.div_(softcap).tanh_()
    return t * softcap, t


def _exact(weight: torch.Tensor) -> torch.dtype:
    """The dtype the vocabulary-wide math runs in: float64 for a float64 head (gradcheck), float32 otherwise."""
    return torch.float64 if weight.dtype == torch.float64 else torch.float32


def _chunk_stats(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logsumexp [R], entropy [R] of softmax within the chunk) of s [R, C], which it overwrites. With m the row max
    and e = exp(s - m): lse = m + log S, S = sum e, and H = log S - sum e (s - m) / S, a sum of two terms >= 0 (no
    cancellation); three passes over the block besides the max."""
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, 0.0)  # a row of -inf only: lse = -inf, H NaN (its share is 0)
    shifted = s.sub_(m).clamp_min_(LOGP_FLOOR)  # -inf -> -1e4: exp 0, and 0 * -1e4 = 0 in the sum
    e = torch.exp(shifted)
    total = e.sum(-1)
    log_total = torch.log(total)
    return m[:, 0] + log_total, log_total - torch.linalg.vecdot(e, shifted) / total


class _ChunkedHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, token_ids, temperature: float, softcap, shape):
        ctx.set_materialize_grads(False)
        n, vocab = hidden.shape[0], weight.shape[0]
        r, c = shape
        chunks = [slice(k, min(k + c, vocab)) for k in range(0, vocab, c)]
        lses, ents = (torch.empty(n, len(chunks), dtype=_exact(weight)) for _ in range(2))
        s_y = torch.empty(n, dtype=_exact(weight))
        for r0 in range(0, n, r):
            rows, h, y = slice(r0, r0 + r), hidden[r0:r0 + r], token_ids[r0:r0 + r]
            for k, cols in enumerate(chunks):
                s, _ = _block_logits(h, weight, bias, cols, softcap)
                if temperature != 1.0:
                    s.div_(temperature)
                inside = (y >= cols.start) & (y < cols.stop)
                local = (y - cols.start).clamp(0, s.shape[1] - 1)
                s_y[rows] = torch.where(inside, s.gather(1, local[:, None])[:, 0], s_y[rows])
                lses[rows, k], ents[rows, k] = _chunk_stats(s)
        lse = torch.logsumexp(lses, dim=-1)
        share = torch.exp(lses - lse[:, None])  # w_k; log w_k = lses - lse
        # a chunk of -inf logits only (w_k = 0) has H_k = NaN: it adds nothing
        entropy = torch.where(share > 0, share * (ents - (lses - lse[:, None])), 0.0).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, token_ids, lse, entropy)
        ctx.temperature, ctx.softcap, ctx.shape = temperature, softcap, (r, c)
        return s_y - lse, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_picked, grad_entropy):
        hidden, weight, bias, token_ids, lse, entropy = ctx.saved_tensors
        need_h, need_w, _, _, _, _, _ = ctx.needs_input_grad
        need_b = bias is not None and ctx.needs_input_grad[2]
        if (grad_picked is None and grad_entropy is None) or not (need_h or need_w or need_b):
            return None, None, None, None, None, None, None
        (r, c), vocab = ctx.shape, weight.shape[0]
        exact = _exact(weight)
        grad_h = torch.zeros(hidden.shape, dtype=exact) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=exact) if need_w else None
        grad_b = torch.zeros(vocab, dtype=exact) if need_b else None
        for r0 in range(0, hidden.shape[0], r):
            rows = slice(r0, r0 + r)
            h, gl = hidden[rows], None if grad_picked is None else grad_picked[rows]
            gh = None if grad_entropy is None else grad_entropy[rows]
            for k in range(0, vocab, c):
                cols = slice(k, min(k + c, vocab))
                g = _block_grad(h, weight, bias, cols, token_ids[rows], lse[rows], entropy[rows], gl, gh,
                                ctx.temperature, ctx.softcap)
                if need_h:
                    grad_h[rows].addmm_(g, weight[cols].to(exact))
                if need_w:
                    grad_w[cols].addmm_(g.T, h.to(exact))
                if need_b:
                    grad_b[cols] += g.sum(0)
        cast = lambda g, like: None if g is None else g.to(like.dtype)  # noqa: E731
        return cast(grad_h, hidden), cast(grad_w, weight), cast(grad_b, bias), None, None, None, None


def _block_grad(h, weight, bias, cols: slice, y, lse, entropy, gl, gh, temperature: float, softcap):
    """d loss / d z [R, C] float32 of one block (z the raw logits h W^T + b of the chunk's columns)."""
    s, t = _block_logits(h, weight, bias, cols, softcap)
    if temperature != 1.0:
        s.div_(temperature)
    logp = s.sub_(lse[:, None])
    # d/ds_j = p_j c_j + gL [j = y], c_j = -gL - gH (log p_j + H), as in ops/fused_logprobs.py
    if gh is not None:
        coef = (logp.clamp_min_(LOGP_FLOOR) + entropy[:, None]).mul_(-gh[:, None])
        if gl is not None:
            coef.sub_(gl[:, None])
    else:
        coef = -gl[:, None]  # p_j = exp(-inf) = 0 needs no floor here
    g = logp.exp_().mul_(coef)
    if gl is not None:
        inside = ((y >= cols.start) & (y < cols.stop)).nonzero()[:, 0]
        g.index_put_((inside, y[inside] - cols.start), gl[inside], accumulate=True)
    if temperature != 1.0:
        g.div_(temperature)
    if t is not None:
        g.mul_(1 - t * t)
    return g


def chunked_logprobs_and_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                 token_ids: torch.Tensor, temperature: float, softcap: float | None = None,
                                 entropy_grad: bool = False,
                                 block: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(z / T)[y] and the entropy of softmax(z / T) for the logits z = head(hidden) (softcapped when
    `softcap`), every token kept (no top-k / top-p), without materialising z [n, V] (module docstring).

    hidden [n, H] float, weight [V, H] (the head's; the input embedding's when tied), bias [V] or None, token_ids
    [n] int64 -> (logprobs [n] float32 with grad to hidden, weight and bias; entropy [n] float32, detached unless
    `entropy_grad`), nats. `block` (R, C): rows per block and columns per vocabulary chunk (None: block_shape's, about
    3 x BLOCK_BYTES of temporaries, besides the gradients' own size). Raises ValueError on a non-positive or non-finite
    temperature or softcap, a non-positive block, mismatched shapes or dtypes, or a token id outside [0, V)."""
    if not 0 < temperature < float("inf"):  # NaN fails too
        raise ValueError(f"temperature must be finite and > 0, got {temperature}")
    if softcap is not None and not 0 < softcap < float("inf"):
        raise ValueError(f"softcap must be finite and > 0 or None, got {softcap}")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} must be [n, H] and [V, H]")
    if hidden.dtype != weight.dtype:  # the head's own matmul would fail with torch's bare dtype message
        raise ValueError(f"hidden ({hidden.dtype}) and the head's weight ({weight.dtype}) must have one dtype")
    if token_ids.shape != hidden.shape[:1] or (bias is not None and bias.shape != weight.shape[:1]):
        raise ValueError(f"token_ids {tuple(token_ids.shape)} / bias must be [n] / [V] for hidden "
                         f"{tuple(hidden.shape)}, weight {tuple(weight.shape)}")
    if len(token_ids) and not 0 <= int(token_ids.min()) <= int(token_ids.max()) < weight.shape[0]:
        raise ValueError(f"token_ids outside the vocabulary [0, {weight.shape[0]})")
    shape = block_shape(hidden.shape[0], weight.shape[0]) if block is None else tuple(block)
    if min(shape) < 1:
        raise ValueError(f"block must be positive, got {block}")
    picked, entropy = _ChunkedHead.apply(hidden, weight, bias, token_ids, float(temperature),
                                         None if softcap is None else float(softcap), shape)
    if not (entropy_grad and torch.is_grad_enabled()):
        entropy = entropy.detach()
    return picked, entropy
