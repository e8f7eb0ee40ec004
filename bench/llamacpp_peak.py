"""llama.cpp's own arithmetic rate on this CPU, beside the GEMM peak the rollout roofline divides by (issue 39
item 3): the roofline (engines/roofline.py) counts a decode step's FLOPs at torch's fp32 GEMM peak, but the engine
multiplies with the pinned llama.cpp build's kernels (AVX2, no AVX-512: the Makefile's LLAMA_CMAKE_ARGS). How fast
do those kernels go where arithmetic is what limits them (one large batch)?

The probe: SmolLM2 exported at each --precisions (the shipped Q4_1 GGUF dequantized, then llama.cpp's quantizer, as
the main job's engine gets it), loaded by llama_cpp.Llama in this process, evaluates one prompt of --tokens random
token ids in one batch (a prefill: one matrix product per weight over every token, the best case for arithmetic
intensity), with logits at every position (logits_all, so the LM head runs on every token as in a decode step;
copying them out, about 0.1 GB at T = 512, is in the time, so the rate is a slight underestimate). H is the embedding
width (SmolLM2's query width). FLOPs = 2 N T + 2 L H T^2 (causal attention: T (T + 1) / 2 positions, QK^T and AV at 2
H each); the best of --repeats runs (KV cache cleared between runs). The same process measures the GEMM peak the
run's roofline uses (engines/roofline.measure_rates: the best 512^3 fp32 product of one thread times the threads).

    .venv/bin/python bench/llamacpp_peak.py [--threads 2] [--tokens 512] [--repeats 5] \
        [--out docs/bench/llamacpp-peak.md]

Run it on a quiet machine: a busy core slows llama.cpp's spin-waiting thread pool far more than its share."""

from __future__ import annotations

import argparse
import platform
import random
import tempfile
import time
from pathlib import Path

import torch

from nearpolicy.doctor import cpu_model


def prefill_seconds(gguf: Path, tokens: int, threads: int, repeats: int) -> tuple[float, int, int, int]:
    """(best seconds of one prefill of `tokens` random ids, parameters N, layers L, query width H)."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=tokens + 16, n_batch=tokens, n_ubatch=tokens,
                          n_threads=threads, n_threads_batch=threads, verbose=False, logits_all=True)
    rng = random.Random(0)
    ids = [rng.randrange(1000, llm.n_vocab()) for _ in range(tokens)]
    times = []
    for _ in range(repeats + 1):
        llm.reset()  # eval() then drops the KV cache from position 0
        start = time.perf_counter()
        llm.eval(ids)
        times.append(time.perf_counter() - start)
    best = min(times[1:])  # the first run warms up and is dropped
    meta = llm.metadata
    arch = meta["general.architecture"]
    layers, width = int(meta[f"{arch}.block_count"]), int(meta[f"{arch}.embedding_length"])
    parameters = int(llama_cpp.llama_model_n_params(llm.model))
    llm.close()
    return best, parameters, layers, width


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--precisions", nargs="+", default=["q8_0", "f32"])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    from nearpolicy.engines.gguf.export import export_model_gguf
    from nearpolicy.engines.roofline import measure_rates
    from nearpolicy.model.load import default_model_gguf, load_policy

    torch.set_num_threads(args.threads)
    rates = measure_rates()
    model, tokenizer = load_policy("smollm2")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for precision in args.precisions:
            folder = Path(tmp) / precision
            folder.mkdir()
            gguf = export_model_gguf(model, folder, precision, (), default_model_gguf(), tokenizer)
            seconds, n, layers, width = prefill_seconds(gguf, args.tokens, args.threads, args.repeats)
            flops = 2.0 * n * args.tokens + 2.0 * layers * width * args.tokens**2
            rows.append((precision, seconds, flops / seconds / 1e9, n))
    peak = rates.peak_flops / 1e9
    lines = [
        "# llama.cpp's own arithmetic rate against the roofline's GEMM peak",
        "",
        f"Written by `bench/llamacpp_peak.py --threads {args.threads} --tokens {args.tokens} --repeats "
        f"{args.repeats}` on {cpu_model()} ({platform.machine()}), {time.strftime('%Y-%m-%d')}; "
        f"torch {torch.__version__}.",
        "",
        f"- The roofline's GEMM peak, measured in this process: {peak:.1f} GFLOP/s (fp32, {args.threads} "
        f"thread(s)); memory bandwidth {rates.bandwidth / 1e9:.1f} GB/s.",
        f"- One prefill of {args.tokens} random token ids in one batch (n_batch = n_ubatch = {args.tokens}), "
        f"best of {args.repeats} after a warm-up; FLOPs = 2 N T + 2 L H T^2.",
        "",
        "| llama.cpp weights | parameters N | prefill seconds | GFLOP/s | of the GEMM peak |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {p} | {n / 1e6:.1f} M | {s:.3f} | {g:.1f} | {100 * g / peak:.0f} % |" for p, s, g, n in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
