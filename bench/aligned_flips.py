"""How much of the aligned trainer's remaining gap to a quantized llama.cpp engine rounding flips explain
(docs/aligned.md). Teacher-forces one fixed response of SmolLM2-135M-Instruct and prints, per engine spec, the mean
and max |log-prob difference| (nats) of the plain and of the aligned trainer against the engine, then the aligned
trainer's own movement when every value is perturbed by a relative `eps` just before each of its roundings (the size
of a float32 summation-order difference): when that movement is as large as the gap, the gap is rounding flips.

    PYTHONPATH=src .venv/bin/python bench/aligned_flips.py q8_0:f32 q4_1:f32 --out /tmp/aligned-flips

A spec is PRECISION[+SELECTOR=PRECISION...]:KV_CACHE, e.g. f32+embeddings=q8_0:f32 (only the tied embeddings / LM head at q8_0).
One thread; the GGUFs go to --out."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

import nearpolicy.model.aligned as aligned
from nearpolicy.engines.gguf.export import export_gguf
from nearpolicy.engines.factory import EngineInputs, EngineRequest, build_engine
from nearpolicy.model.load import default_model_gguf, load_policy
from nearpolicy.types import SamplingParams

QUESTION = "What is 3 + 4? Answer briefly."
RESPONSE = "The answer is 7. Because 3 plus 4 equals seven, that is the sum of the two numbers you gave."


def trainer_logprobs(model, prompt: list[int], completion: list[int]) -> np.ndarray:
    """[T] float32 log-probs (T = 1, no top-k / top-p) of `completion` after `prompt` under `model`."""
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt + completion])).logits[0].float(), -1)
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(completion) - 1)
    return logp[positions, torch.tensor(completion)].numpy()


def jittered(model, prompt, completion, eps: float) -> np.ndarray:
    """Aligned log-probs with every value scaled by (1 + eps z) before each rounding (the model is aligned)."""
    fp16, fake_quant = aligned.round_fp16, aligned.fake_quant_activation
    noise = lambda t: t * (1 + eps * torch.randn_like(t))  # noqa: E731
    aligned.round_fp16 = lambda t: fp16(noise(t))
    aligned.fake_quant_activation = lambda t, fmt, rule="avx2": fake_quant(noise(t), fmt, rule)
    try:
        return trainer_logprobs(model, prompt, completion)
    finally:
        aligned.round_fp16, aligned.fake_quant_activation = fp16, fake_quant


def gap(a: np.ndarray, b: np.ndarray) -> str:
    return f"mean {np.abs(a - b).mean():.3g} max {np.abs(a - b).max():.3g}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("specs", nargs="+")
    parser.add_argument("--out", type=Path, default=Path("/tmp/aligned-flips"))
    parser.add_argument("--eps", type=float, nargs="+", default=[1e-7, 1e-6])
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, tokenizer = load_policy(str(default_model_gguf()))
    model.float().eval().requires_grad_(False)
    prompt = list(tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                                tokenize=True, return_dict=False))
    completion = tokenizer.encode(RESPONSE)
    plain = trainer_logprobs(model, prompt, completion)
    args.out.mkdir(parents=True, exist_ok=True)
    for spec in args.specs:
        weights, kv_cache = spec.split(":")
        precision, *overrides = weights.split("+")
        tensor_precision = tuple(tuple(o.split("=")) for o in overrides)
        path = args.out / f"smollm2-{weights.replace('=', '_').replace('+', '-')}.gguf"
        if not path.exists():
            export_gguf(model.state_dict(), model.config, path, precision, template_gguf=default_model_gguf(),
                        tensor_precision=tensor_precision)
        request = EngineRequest("llamacpp", precision, max_context=256, max_parallel_sequences=1, threads=1,
                                tensor_precision=tensor_precision, kv_cache=kv_cache, adaptive_threads=False,
                                isolated=False)
        engine = build_engine(request, EngineInputs(gguf=path))
        reference = np.array(engine.score(prompt, completion, SamplingParams()))
        engine.close()
        with aligned.align_model(model, precision, tensor_precision, kv_cache=kv_cache):
            base = trainer_logprobs(model, prompt, completion)
            print(f"{spec}: {len(completion)} tokens | plain vs engine {gap(plain, reference)} | aligned vs engine "
                  f"{gap(base, reference)}")
            for eps in args.eps:
                print(f"  aligned, jitter {eps:g} before each rounding, vs itself: "
                      f"{gap(jittered(model, prompt, completion, eps), base)}")


if __name__ == "__main__":
    main()
