"""`nearpolicy doctor`: what a bug report needs, measured on this machine: CPU model and SIMD flags, llama.cpp's
compiled features and a startup probe of the shipped GGUF with llama.cpp's extra buffers off and on (each in its own
process, so a crash is reported, not suffered), torch's version, threads, GEMM GFLOP/s and memory bandwidth (their
probes live in engines/roofline.py, shared with a run's start; the "roofline rates" line gives the two rates the
rollout's bound uses), free disk for checkpoints, and the Chromium the report test drives. Exit code 1 when a required
piece is missing."""

from __future__ import annotations

import os
import platform
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from nearpolicy.engines.roofline import gemm_gflops, measure_rates, memory_bandwidth

SIMD_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_int8", "amx_bf16")
CHECKPOINT_GB = 1.6  # fp32 SmolLM2-135M + AdamW moments, one checkpoint (README)


@dataclass
class Check:
    name: str
    value: str
    ok: bool = True
    required: bool = True

    def line(self) -> str:
        mark = "ok  " if self.ok else ("FAIL" if self.required else "warn")
        return f"[{mark}] {self.name:<24} {self.value}"


def cpu_facts(cpuinfo: str) -> tuple[str, set[str]]:
    """(model name, set of flags) from the text of /proc/cpuinfo (first processor)."""
    model, flags = None, None
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and model is None:
            model = value.strip()
        elif key.strip() == "flags" and flags is None:
            flags = set(value.split())
    return model or platform.processor() or "unknown", flags or set()


def cpu_model(path: str = "/proc/cpuinfo") -> str:
    """The CPU's model name (cpu_facts of /proc/cpuinfo; platform.processor() where that file is unreadable)."""
    try:
        return cpu_facts(Path(path).read_text())[0]
    except OSError:
        return platform.processor() or "unknown"


def engine_probe(extra_buffers: bool) -> Check:
    """Load the shipped Q4_1 GGUF in a child process and decode a few tokens (the run's startup probe)."""
    from nearpolicy.engines.base import EngineError
    from nearpolicy.engines.factory import EngineInputs, EngineRequest, build_engine
    from nearpolicy.model.load import default_model_gguf

    name = f"probe extra_buffers={'on' if extra_buffers else 'off'}"
    try:
        gguf = default_model_gguf()
    except (FileNotFoundError, ImportError) as err:
        return Check(name, f"no shipped GGUF ({err})", ok=False)
    request = EngineRequest("llamacpp", "q4_1", max_context=256, max_parallel_sequences=4, threads=2,
                            extra_buffers=extra_buffers)
    t0 = time.perf_counter()
    try:
        engine = build_engine(request, EngineInputs(gguf, probe_prompt=[1, 9690, 28, 2], start_timeout_s=120))
    except EngineError as err:  # EngineDied included: the crash this probe exists to catch
        return Check(name, str(err).splitlines()[0], ok=False, required=not extra_buffers)
    engine.close()
    return Check(name, f"decoded q4_1 in a child process in {time.perf_counter() - t0:.1f} s",
                 required=not extra_buffers)


def machine_load(load_1min: float, cores: int, running_now: float | None = None) -> Check:
    """Whether other work competes for the cores: every time and GFLOP/s below (and any benchmark) reads low then.
    Busy when the other tasks runnable now (`running_now`, others_running) exceed half the cores; where that is
    unknown (not Linux), when the 1-min load average does. The average lags by about a minute both ways: work that
    just ended (make train's own pip install) would read as load, work that just began as none."""
    busy = (running_now if running_now is not None else load_1min) > 0.5 * cores
    said = f"{load_1min:.1f} runnable processes (1-min load average)"
    said += "" if running_now is None else f", {running_now:g} other tasks running now"
    return Check("load", f"{said} on {cores} cores" + (
        "; the machine is busy: timings and GEMM speed read low" if busy else ", quiet"), ok=not busy, required=False)


def others_running(samples: int = 5, interval_s: float = 0.05) -> float | None:
    """The median over `samples` reads, `interval_s` apart, of the tasks runnable now (/proc/stat's procs_running)
    less this one; None where /proc/stat has no such line (not Linux)."""
    counts = []
    for i in range(samples):
        try:
            lines = Path("/proc/stat").read_text().splitlines()
            counts.append(max(0, int(next(line for line in lines if line.startswith("procs_running ")).split()[1]) - 1))
        except (OSError, StopIteration, IndexError, ValueError):  # no /proc/stat, no such line, or an odd one
            return None
        if i + 1 < samples:
            time.sleep(interval_s)
    return float(sorted(counts)[len(counts) // 2]) if counts else None


def checks(runs_dir: Path, probe: bool = True) -> list[Check]:
    import torch

    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model, flags = cpu_facts(cpuinfo)
    simd = " ".join(f for f in SIMD_FLAGS if f in flags) or "none of " + " ".join(SIMD_FLAGS)
    out = [Check("cpu", f"{model} ({platform.machine()})"),
           Check("cpu flags", simd, ok=platform.machine() != "x86_64" or "avx2" in flags),
           machine_load(os.getloadavg()[0], os.cpu_count() or 1, others_running()),
           Check("torch", f"{torch.__version__}, {torch.get_num_threads()} threads")]
    fp32, bw = gemm_gflops(torch.float32), memory_bandwidth()
    out += [Check("gemm fp32", f"{fp32:.0f} GFLOP/s (512^3, torch)"),
            Check("gemm bf16", f"{gemm_gflops(torch.bfloat16):.0f} GFLOP/s (512^3, torch)"),
            Check("memory bandwidth", f"copy {bw['copy']:.1f} GB/s, triad {bw['triad']:.1f} GB/s (128 MiB float32 "
                  "arrays, torch, best of 5)"),
            Check("roofline rates", measure_rates().describe() + " (the rollout's bound, rollout/roofline_s: "
                  "the fastest one-thread product times the threads, an upper bound on the gemm lines above; "
                  "engines/roofline.measure_rates, as a run's start measures them)")]
    try:
        import llama_cpp

        from nearpolicy.engines.llama_lib import system_info

        out.append(Check("llama-cpp-python", f"{llama_cpp.__version__}: {system_info()}"))
        if probe:
            out += [engine_probe(False), engine_probe(True)]
    except ImportError as err:
        out.append(Check("llama-cpp-python", f"not importable ({err})", ok=False))
    where = runs_dir.resolve() if runs_dir.exists() else f"{Path.cwd()} ({runs_dir} does not exist yet)"
    free_gb = shutil.disk_usage(runs_dir if runs_dir.exists() else Path.cwd()).free / 1e9
    out.append(Check("disk", f"{free_gb:.1f} GB free at {where} (a checkpoint of the main job: "
                     f"{CHECKPOINT_GB} GB, two kept)", ok=free_gb > 3 * CHECKPOINT_GB, required=False))
    chromium = shutil.which("chromium") or (Path("/usr/bin/chromium").exists() and "/usr/bin/chromium")
    out.append(Check("chromium", chromium or "absent (only the report test needs it)", ok=bool(chromium),
                     required=False))
    return out


def doctor(runs_dir: Path = Path("runs"), probe: bool = True, echo=print) -> int:
    """Print every check; 0 when every required one passes, else 1."""
    failed = False
    for check in checks(runs_dir, probe):
        echo(check.line())
        failed |= check.required and not check.ok
    return 1 if failed else 0
