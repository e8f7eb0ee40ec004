"""The transformers engine's decode step: a batch of sequences, one new token each, on a key/value cache.

Two steppers with one interface (`start`, `step`, `keep`), both returning float32 logits [B, V]:
- `LlamaStepper`, for Llama-architecture policies (SmolLM2, the default): the engine's own copy of the weights in
  the engine dtype, q/k/v and gate/up projections concatenated into one matrix each and handed to oneDNN pre-packed
  where torch has it (`torch.ops.mkldnn`; plain `F.linear` otherwise), a preallocated key/value cache written in
  place, and single-query attention with the query heads of one key/value head as the rows of one query block
  (grouped-query attention without repeating the cache). The norms, rotary tables and activation are the
  transformers modules' own, so at fp32 the logits equal the transformers forward to float32 rounding
  (tests/test_hf_decode.py). Why: on a 2-core Xeon with AMX a bf16 decode step of SmolLM2-135M at 32 sequences
  takes 44 ms against 69 ms through the transformers forward, and rollouts run 2.2x faster (docs/results.md
  sec. 13).
- `TransformersStepper`, any other causal LM: the model's own forward on a transformers DynamicCache.

Both prefill each distinct prompt once and copy its cache rows to every sample of it (a group's G samples share
their prompt), and drop finished rows from the batch (`keep`) so attention stops paying for them, where the cache
allows it (`can_drop_rows`: not the linear-attention layers of hybrid models, whose samples each prefill their prompt
and stay in the batch).
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F

from nearpolicy.types import GenerationRequest

COMPACT_BELOW = 0.75  # drop finished rows once the live ones are under this share of the batch's rows


def make_stepper(model: torch.nn.Module):
    """The fastest stepper for `model` (a transformers causal LM in eval mode, weights in the engine dtype)."""
    return LlamaStepper(model) if LlamaStepper.supports(model) else TransformersStepper(model)


def left_padded(prompts: list[tuple[int, ...]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [U, W] int64, valid [U, W] bool, positions [U, W] int64): prompts right-aligned (left padding) so each
    one's last token is in the last column; a token's position counts the real tokens before it (0 at padding).
    Raises ValueError for an empty prompt (nothing to predict the first token from)."""
    if any(len(p) == 0 for p in prompts):
        raise ValueError("the hf engine needs at least one prompt token per request")
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    valid = torch.zeros((len(prompts), width), dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        valid[i, width - len(p):] = True
    return ids, valid, (valid.long().cumsum(-1) - 1).clamp_min(0)


def sample_rows_of(requests: list[GenerationRequest]) -> tuple[list[tuple[int, ...]], torch.Tensor]:
    """(distinct prompts [U], rows [B] int64): each sample's index into the distinct prompts, samples ordered by
    (request, sample index)."""
    distinct: dict[tuple[int, ...], int] = {}
    rows = [distinct.setdefault(tuple(r.prompt_ids), len(distinct)) for r in requests for _ in range(r.n)]
    return list(distinct), torch.tensor(rows, dtype=torch.long)


class _Linear:
    """y = x W^T (+ b) for x [N, in]; W pre-packed for oneDNN when torch can (same values, faster reads)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight, self.bias, self.packed = weight.contiguous(), bias, None
        if _packing_works(self.weight.dtype):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, 32)  # 32: the batch it is tuned for
            self.weight = None  # the packed copy is the one read

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")


@functools.lru_cache(maxsize=None)
def _packing_works(dtype: torch.dtype) -> bool:
    """Whether this torch and this CPU run a oneDNN pre-packed linear in `dtype` (checked once, on a 4 x 8 weight
    against F.linear): oneDNN's bf16 kernels need AVX-512 BF16 or AMX, and some builds have no mkldnn ops."""
    if not torch.backends.mkldnn.is_available():
        return False
    weight, x = torch.randn(4, 8).to(dtype), torch.randn(2, 8).to(dtype)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 32)
        out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    return torch.allclose(out.float(), F.linear(x, weight).float(), rtol=2e-2, atol=2e-2)


def _joined(*modules: torch.nn.Linear) -> _Linear:
    biases = [m.bias for m in modules]
    bias = None if all(b is None for b in biases) else torch.cat(
        [b if b is not None else torch.zeros(m.out_features, dtype=m.weight.dtype) for m, b in zip(modules, biases)])
    return _Linear(torch.cat([m.weight for m in modules]), bias)


class LlamaStepper:
    """Decode steps of a transformers LlamaForCausalLM (module docstring). Cache per layer: keys and values
    [B, Hkv, capacity, D] in the model dtype, columns 0..width-1 the left-padded prompts, then one column per step;
    `mask` [B, 1, 1, capacity] is 0 where a column holds a real token and the dtype's minimum at left padding."""

    @staticmethod
    def supports(model: torch.nn.Module) -> bool:
        config = getattr(model, "config", None)
        return (getattr(config, "model_type", None) == "llama" and not getattr(config, "mlp_bias", False)
                and hasattr(getattr(model, "model", None), "rotary_emb"))

    def __init__(self, model: torch.nn.Module):
        from transformers.models.llama.modeling_llama import rotate_half

        base, config = model.model, model.config
        self.rotate_half = rotate_half
        self.model, self.dtype = model, model.get_output_embeddings().weight.dtype
        attention = base.layers[0].self_attn
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim, self.scaling = attention.head_dim, attention.scaling
        self.repack()
        self._buffers: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []  # two sets: (keys, values)
        self._live = 0  # the buffer set self.keys / self.values are views of
        self.can_drop_rows = True
        self.keys: list[torch.Tensor] = []  # per layer, views [B, Hkv, capacity, D] of one buffer set
        self.values: list[torch.Tensor] = []

    def repack(self) -> None:
        """Rebuild the joined, packed projection weights from the model's modules (after new weights were loaded
        into them); the cache buffers stay."""
        self.layers = [(layer.input_layernorm, _joined(layer.self_attn.q_proj, layer.self_attn.k_proj,
                                                       layer.self_attn.v_proj),
                        _Linear(layer.self_attn.o_proj.weight, layer.self_attn.o_proj.bias),
                        layer.post_attention_layernorm,
                        _joined(layer.mlp.gate_proj, layer.mlp.up_proj), _Linear(layer.mlp.down_proj.weight, None),
                        layer.mlp.act_fn) for layer in self.model.model.layers]
        self.head = _Linear(self.model.get_output_embeddings().weight, None)

    @torch.no_grad()
    def start(self, prompts: list[tuple[int, ...]], rows: torch.Tensor, capacity: int, pad_id: int) -> torch.Tensor:
        """Prefill the distinct `prompts` once, then give each of the B = len(rows) sequences a copy of its prompt's
        cache (`rows` [B] indexes `prompts`); room for `capacity` - W more tokens. Returns logits [B, V] float32."""
        ids, valid, positions = left_padded(prompts, pad_id)
        n, width = ids.shape
        self._reserve(max(n, len(rows)), capacity)
        self._live = 0
        self.keys, self.values = [k[:n] for k in self._buffers[0][0]], [v[:n] for v in self._buffers[0][1]]
        causal = torch.ones(width, width, dtype=torch.bool).tril()
        allowed = (causal & valid[:, None, :]) | torch.eye(width, dtype=torch.bool)  # a pad query sees itself
        lowest = torch.finfo(self.dtype).min
        self.mask = torch.full((n, 1, 1, capacity), lowest, dtype=self.dtype)
        self.mask[:, 0, 0, :width].masked_fill_(valid, 0.0)
        self.width = width
        prompt_mask = torch.zeros(allowed.shape, dtype=self.dtype).masked_fill(~allowed, lowest)
        logits = self._forward(ids, positions, prompt_mask[:, None], 0)
        self.positions = positions[:, -1]
        self.keep(rows)
        return logits[rows]

    @torch.no_grad()
    def step(self, ids: torch.Tensor) -> torch.Tensor:
        """Append one token per live sequence (ids [B] int64); returns logits [B, V] float32 for the next one."""
        self.positions = self.positions + 1
        column = self.width
        self.width += 1
        self.mask[:, :, :, column] = 0.0
        return self._forward(ids[:, None], self.positions[:, None], self.mask[:, :, :, : self.width], column)

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only the sequences `rows` [B'] (int64 indices into the current batch), in that order: gathered into
        the other buffer set, which becomes the live one (no allocation, so no page faults on fresh memory)."""
        m, self._live = len(rows), 1 - self._live
        keys, values = self._buffers[self._live]
        self.keys = [torch.index_select(k, 0, rows, out=into[:m]) for k, into in zip(self.keys, keys)]
        self.values = [torch.index_select(v, 0, rows, out=into[:m]) for v, into in zip(self.values, values)]
        self.mask, self.positions = self.mask.index_select(0, rows), self.positions.index_select(0, rows)

    def _reserve(self, rows: int, capacity: int) -> None:
        """Two buffer sets, each (keys, values) per layer [rows, Hkv, capacity, D], kept across calls while they hold
        the call and are at most twice its size in rows and in columns (a compaction copies whole buffers), else
        made anew at the call's size. Made outside inference mode, so a later call outside it may write them."""
        have = self._buffers[0][0][0].shape if self._buffers else (0, 0, 0, 0)
        if not (rows <= have[0] <= 2 * rows and capacity <= have[2] <= 2 * capacity):
            self._buffers = []  # the old ones go before the new ones are made
            shape = (rows, self.kv_heads, capacity, self.head_dim)
            with torch.inference_mode(False):
                self._buffers = [tuple([torch.empty(shape, dtype=self.dtype) for _ in self.layers] for _ in range(2))
                                 for _ in range(2)]

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, column: int) -> torch.Tensor:
        """ids [B, S] at positions [B, S], written to cache columns column..column+S-1, attending under mask
        (additive, broadcastable to [B, Hkv, S or G, column + S]) -> logits [B, V] float32 after the last of them
        (the LM head runs on that position only)."""
        batch, steps = ids.shape
        x = self.model.get_input_embeddings()(ids)  # [B, S, H]
        cos, sin = self.model.model.rotary_emb(x, positions)  # [B, S, D]
        cos, sin = cos[:, :, None], sin[:, :, None]
        q_dim, kv_dim, end = self.heads * self.head_dim, self.kv_heads * self.head_dim, column + steps
        for (norm1, qkv_proj, o_proj, norm2, gate_up, down, act), keys, values in zip(self.layers, self.keys,
                                                                                       self.values):
            qkv = qkv_proj(_rms_norm(x, norm1).reshape(batch * steps, -1)).view(batch, steps, -1)
            qk = qkv[..., : q_dim + kv_dim].view(batch, steps, self.heads + self.kv_heads, self.head_dim)
            qk = qk * cos + self.rotate_half(qk) * sin
            keys[:, :, column:end] = qk[:, :, self.heads:].transpose(1, 2)
            values[:, :, column:end] = qkv[..., q_dim + kv_dim:].view(batch, steps, self.kv_heads,
                                                                      self.head_dim).transpose(1, 2)
            attended = self._attend(qk[:, :, : self.heads], keys[:, :, :end], values[:, :, :end], mask)
            x = x + o_proj(attended.reshape(batch * steps, q_dim)).view(batch, steps, -1)
            h = gate_up(_rms_norm(x, norm2).reshape(batch * steps, -1))
            half = h.shape[-1] // 2
            x = x + down(act(h[:, :half]) * h[:, half:]).view(batch, steps, -1)
        return self.head(_rms_norm(x[:, -1], self.model.model.norm)).float()

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [B, S, Hq, D] against keys / values [B, Hkv, L, D] -> [B, S, Hq, D]. One query position (decode): the
        Hq / Hkv query heads of each key/value head are the rows of one [G, D] query block."""
        batch, steps = q.shape[:2]
        if steps == 1:
            block = q.view(batch, self.kv_heads, self.heads // self.kv_heads, self.head_dim)
            out = F.scaled_dot_product_attention(block, keys, values, attn_mask=mask, scale=self.scaling)
            return out.reshape(batch, 1, self.heads, self.head_dim)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask, scale=self.scaling,
                                             enable_gqa=True)
        return out.transpose(1, 2)


def _rms_norm(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    """A LlamaRMSNorm module's output, through torch's fused kernel (the same float32 statistics, fewer ops)."""
    return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)


class TransformersStepper:
    """Decode steps through the model's own forward and a transformers DynamicCache (any causal LM that takes
    `attention_mask`, `position_ids` and a cache)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.can_drop_rows = True  # set by each start from the model's cache layers

    def repack(self) -> None:
        """Nothing to rebuild: the model's forward reads its modules' weights."""

    @torch.no_grad()
    def start(self, prompts: list[tuple[int, ...]], rows: torch.Tensor, capacity: int, pad_id: int) -> torch.Tensor:
        """As LlamaStepper.start (capacity unused: the cache grows)."""
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)
        self.can_drop_rows = all(callable(getattr(layer, "batch_select_indices", None)) for layer in self.cache.layers)
        if not self.can_drop_rows:  # e.g. linear-attention layers of hybrid models: every sample prefills its prompt
            prompts, rows = [prompts[r] for r in rows.tolist()], torch.arange(len(rows))
        ids, valid, positions = left_padded(prompts, pad_id)
        self.attention = valid.long()
        # only the last position's logits: all P of them are P MiB a row in float32 at Gemma 3's 262k vocabulary
        last = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(self.model.forward).parameters else {}
        out = self.model(input_ids=ids, attention_mask=self.attention, position_ids=positions, cache=self.cache,
                         use_cache=True, **last)
        self.positions = positions[:, -1]
        if self.can_drop_rows:
            self.keep(rows)
        return out.logits[:, -1].float()[rows]

    @torch.no_grad()
    def step(self, ids: torch.Tensor) -> torch.Tensor:
        self.positions = self.positions + 1
        self.attention = torch.cat([self.attention, torch.ones((len(ids), 1), dtype=torch.long)], dim=1)
        out = self.model(input_ids=ids[:, None], attention_mask=self.attention, position_ids=self.positions[:, None],
                         cache=self.cache, use_cache=True)
        return out.logits[:, -1].float()

    def keep(self, rows: torch.Tensor) -> None:
        """As LlamaStepper.keep; only where can_drop_rows (the engine checks)."""
        self.cache.batch_select_indices(rows)
        self.attention, self.positions = self.attention[rows], self.positions[rows]
