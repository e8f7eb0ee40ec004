"""llama.cpp's activation rounding, reproduced in torch (pure math: no I/O, no model).

A quantized matmul in llama.cpp's CPU backend (ggml/src/ggml-cpu/ggml-cpu.c, `ggml_compute_forward_mul_mat`)
first converts each activation row to the weight type's `vec_dot_type` (`type_traits_cpu[...].from_float`), then
takes block dot products. Which format the activations get, per weight type (ggml-cpu.c `type_traits_cpu`):

| weight | activations | rule |
|---|---|---|
| f32 | f32 | unchanged |
| f16 | f16 | round to nearest even (F16C `_cvtss_sh`), `GGML_CPU_FP32_TO_FP16` |
| bf16 | bf16 | round to nearest even, `GGML_FP32_TO_BF16` |
| q8_0, q4_0, q5_0, mxfp4 | q8_0 | `quantize_row_q8_0` below |
| q4_1, q5_1 | q8_1 | `quantize_row_q8_1` below |

q8_0 / q8_1 on x86 with AVX2 (ggml/src/ggml-cpu/arch/x86/quants.c, `quantize_row_q8_0`, `quantize_row_q8_1`; the
path the pinned x86-64-v3 build runs, llama-cpp-python 0.3.36): per block of 32 values, amax = max |x|,
d = amax / 127 (float32), id = 127 / amax (0 when amax = 0), q = round-to-nearest-even(x * id)
(`_mm256_round_ps(..., _MM_ROUND_NEAREST)`), the block stores fp16(d) and the int8 q; q8_1 also stores
s = fp16(d * sum(q)) with the float32 d. The portable reference (ggml/src/ggml-quants.c `quantize_row_q8_0_ref`,
which gguf-py's Q8_0 quantizer mirrors and weights are exported with) differs in two places: id = 1 / d and
roundf (half away from zero); `rule="ref"` reproduces it.

Dot products (arch/x86/quants.c): `ggml_vec_dot_q8_0_q8_0` / `ggml_vec_dot_q4_0_q8_0` sum over blocks
d_w * d_x * sum(q_w q_x), i.e. the float product of the dequantized weight and the dequantized activation
x_hat = fp16(d) * q up to float summation order; `ggml_vec_dot_q4_1_q8_1` sums d_w d_x sum(q_w q_x) + m_w * s, and
since the dequantized weight is d_w q_w + m_w, that is W_deq . x_hat + sum_b m_w,b (s_b - fp16(d_b) sum_b(q)):
`q8_1_sum_residual` gives the bracket.
"""

from __future__ import annotations

import torch

BLOCK = 32  # QK8_0 = QK8_1 = 32 values per block
ACTIVATION_FORMAT: dict[str, str] = {
    "f32": "f32", "f16": "f16", "bf16": "bf16",
    "q8_0": "q8_0", "q4_0": "q8_0", "q5_0": "q8_0", "mxfp4": "q8_0",
    "q4_1": "q8_1", "q5_1": "q8_1",
}
RULES = ("avx2", "ref")


def activation_format(weight_type: str) -> str:
    """The `vec_dot_type` llama.cpp's CPU backend converts activations to for a matmul with a `weight_type`
    weight ("f32", "f16", "bf16", "q8_0" or "q8_1"). Raises ValueError for a type without a known rule."""
    try:
        return ACTIVATION_FORMAT[weight_type]
    except KeyError:
        raise ValueError(f"no activation rule for weight type {weight_type!r}; known: "
                         f"{', '.join(ACTIVATION_FORMAT)}") from None


def round_fp16(x: torch.Tensor) -> torch.Tensor:
    """x rounded to float16 (nearest even) and back, float32, same shape; overflow gives +-inf as F16C does."""
    return x.to(torch.float16).to(x.dtype)


def round_bf16(x: torch.Tensor) -> torch.Tensor:
    """x rounded to bfloat16 (nearest even) and back, same shape and dtype."""
    return x.to(torch.bfloat16).to(x.dtype)


def _round_half_away(v: torch.Tensor) -> torch.Tensor:
    """C's roundf, exact in float32 (gguf-py's np_roundf): |v| = f + r, f = floor |v|, up when r >= 0.5."""
    a = v.abs()
    f = torch.floor(a)
    return torch.sign(v) * (f + (a - f >= 0.5).to(v.dtype))


def quantize_q8_blocks(x: torch.Tensor, rule: str = "avx2") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block-32 int8 quantization of the last dimension of `x` [..., K] (float32, K a multiple of 32).

    Returns (q [..., K/32, 32] float32 holding integers in [-127, 127], d [..., K/32, 1] the float32 scale
    amax / 127, d16 [..., K/32, 1] fp16(d) as float32: the scale the block stores). `rule`: "avx2" (the CPU
    backend's `quantize_row_q8_0`/`_q8_1` on AVX2) or "ref" (`quantize_row_q8_0_ref`, gguf-py). No gradient.
    Raises ValueError (K not a multiple of 32, unknown rule, not float32)."""
    if rule not in RULES:
        raise ValueError(f"unknown q8 rounding rule {rule!r}; valid: {', '.join(RULES)}")
    if x.dtype != torch.float32:
        raise ValueError(f"q8 quantization takes float32 activations, got {x.dtype}")
    if x.shape[-1] % BLOCK:
        raise ValueError(f"row length {x.shape[-1]} is not a multiple of the q8 block size {BLOCK}")
    with torch.no_grad():
        blocks = x.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
        amax = blocks.abs().amax(dim=-1, keepdim=True)
        d = amax / 127.0
        zero = torch.zeros_like(amax)
        if rule == "avx2":
            inv = torch.where(amax != 0, 127.0 / torch.where(amax != 0, amax, 1.0), zero)
            q = torch.round(blocks * inv)  # torch.round: half to even, as _mm256_round_ps(_MM_ROUND_NEAREST)
        else:
            inv = torch.where(d != 0, 1.0 / torch.where(d != 0, d, 1.0), zero)
            q = _round_half_away(blocks * inv)
        return q, d, round_fp16(d)


def fake_quant_q8(x: torch.Tensor, rule: str = "avx2") -> torch.Tensor:
    """x_hat = fp16(d) * q: the activation a q8_0 / q8_1 block dot product multiplies with (float32, shape of `x`
    [..., K]); what `dequantize_row_q8_0` returns for the block llama.cpp stores. No gradient (wrap with
    `straight_through`). Raises as `quantize_q8_blocks`."""
    q, _, d16 = quantize_q8_blocks(x, rule)
    return (q * d16).reshape(x.shape)


def q8_1_sum_residual(x: torch.Tensor, rule: str = "avx2") -> torch.Tensor:
    """Per block, s - fp16(d) * sum(q) [..., K/32] (float32): how much the q8_1 block's stored sum
    s = fp16(d * sum(q)) (float32 d) differs from the sum of the dequantized activations; a q4_1 / q5_1 dot product
    adds the weight block's min m times s (`ggml_vec_dot_q4_1_q8_1`). Exact in float32. No gradient."""
    q, d, d16 = quantize_q8_blocks(x, rule)
    total = q.sum(dim=-1, keepdim=True)  # integers up to 32 * 127: exact
    return (round_fp16(d * total) - d16 * total).squeeze(-1)


def fake_quant_activation(x: torch.Tensor, fmt: str, rule: str = "avx2") -> torch.Tensor:
    """x as the `fmt` activation format holds it ("f32", "f16", "bf16", "q8_0", "q8_1"; float32, shape of `x`).
    No gradient. Raises ValueError for an unknown format, else as `quantize_q8_blocks`."""
    with torch.no_grad():
        if fmt == "f32":
            return x.detach()
        if fmt == "f16":
            return round_fp16(x)
        if fmt == "bf16":
            return round_bf16(x)
        if fmt in ("q8_0", "q8_1"):
            return fake_quant_q8(x, rule)
    raise ValueError(f"unknown activation format {fmt!r}; valid: f32, f16, bf16, q8_0, q8_1")


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, x_hat: torch.Tensor) -> torch.Tensor:  # noqa: ARG004
        return x_hat.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ARG004
        return grad, None


def straight_through(x: torch.Tensor, x_hat: torch.Tensor) -> torch.Tensor:
    """x_hat's values (bit for bit) with x's gradient: d out / d x = identity (the straight-through estimator,
    Bengio et al. 2013, arXiv:1308.3432). Same shape and dtype as `x`; raises ValueError on a shape mismatch."""
    if x.shape != x_hat.shape:
        raise ValueError(f"straight_through: shapes differ, {tuple(x.shape)} vs {tuple(x_hat.shape)}")
    if not x.requires_grad:
        return x_hat
    return _StraightThrough.apply(x, x_hat)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos / sin tables llama.cpp's CPU RoPE uses (ggml/src/ggml-cpu/ops.cpp `ggml_rope_cache_init`, plain
    RoPE: no YaRN, freq_scale 1): theta_0 = position, theta_{i+1} = theta_i * theta_scale in float32 with
    theta_scale = powf(base, -2 / head_dim), then cosf / sinf (here in float64, rounded to float32: correctly
    rounded, as glibc's are to within an ulp). positions [..., T] (integers), returns cos, sin [..., T, head_dim]
    float32, each frequency twice (transformers' half-split layout, `rotate_half`). Raises ValueError (odd head_dim)."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    scale = torch.tensor(float(base), dtype=torch.float64).pow(-2.0 / head_dim).to(torch.float32)
    theta = positions.to(torch.float32)
    thetas = []
    for _ in range(head_dim // 2):
        thetas.append(theta)
        theta = theta * scale
    angles = torch.stack(thetas, dim=-1).to(torch.float64)
    cos, sin = angles.cos().to(torch.float32), angles.sin().to(torch.float32)
    return torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
