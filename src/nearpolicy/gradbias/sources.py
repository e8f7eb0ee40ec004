"""Mismatch sources and corrections of a gradient-bias measurement, by name.

Sources (the engine that samples a replicate's batch; the trainer always scores with its fp32 policy):
  f32          the hf engine in fp32 on the trainer's weights: the null source (bias 0 expected; its seeds differ
               from the reference's, so nothing is shared with it but the prompts)
  <gguf type>  llama.cpp at that GGUF precision (q8_0, q4_1, ...), the trainer's weights exported to it
  bf16         the hf engine in bf16
  noise<std>   llama.cpp at f32 with logit noise of that std (engine.logit_noise, engines/sampling.py), e.g. noise0.5
  stale        llama.cpp at f32 on the weights `warmup` updates old (the start of the warm-up)
(noise and stale run on llama.cpp's f32 kernels, whose own k3 is about 1e-6 (docs/results.md), because the hf
engine's fp32 decode is 5-10x slower on a CPU without AMX; the f32 row shows what the hf reference engine sees.)
Corrections: any preset of ops/correction_presets.py (`nearpolicy list`), plus
  decoupled    AReaL's decoupled PPO weight pi_prox / mu capped at 5 (preset areal_cap), proximal = the trainer
  a3po         token IS with the A-3PO proximal (correction.proximal = a3po): differs from token_is only on stale
               tokens"""

from __future__ import annotations

from dataclasses import dataclass

from nearpolicy.engines.gguf.export import PRECISIONS as GGUF_PRECISIONS

DEFAULT_SOURCES = ("f32", "q8_0", "q4_1", "noise0.2", "noise0.5", "stale")
DEFAULT_CORRECTIONS = ("off", "token_is", "tis", "icepop", "token_mis", "seq_tis", "geo_rs", "decoupled", "a3po",
                       "bypass_ppo_clip")
SPECIAL_CORRECTIONS = {"decoupled": ("correction.preset=areal_cap",),
                       "a3po": ("correction.preset=token_is", "correction.proximal=a3po")}


@dataclass(frozen=True)
class SourceSpec:
    """A parsed source name: engine kind and precision, logit noise std, and whether it holds the stale weights."""

    name: str
    kind: str  # an engine kind of engines/factory.py
    precision: str
    logit_noise: float = 0.0
    stale: bool = False

    @property
    def label(self) -> str:
        what = f"{self.kind}:{self.precision}"
        if self.logit_noise:
            what += f" + logit noise {self.logit_noise:g}"
        return what + (" on stale weights" if self.stale else "")


def parse_source(name: str) -> SourceSpec:
    """The SourceSpec of a source name (module docstring). Raises ValueError naming the valid forms."""
    if name == "f32":
        return SourceSpec(name, "hf", "fp32")
    if name == "bf16":
        return SourceSpec(name, "hf", "bf16")
    if name == "stale":
        return SourceSpec(name, "llamacpp", "f32", stale=True)
    if name.startswith("noise"):
        try:
            std = float(name[len("noise"):])
        except ValueError:
            std = -1.0
        if not std > 0:
            raise ValueError(f"source {name!r}: write noise<std> with std > 0, e.g. noise0.5")
        return SourceSpec(name, "llamacpp", "f32", logit_noise=std)
    if name in GGUF_PRECISIONS:
        return SourceSpec(name, "llamacpp", name)
    raise ValueError(f"unknown source {name!r}; valid: f32, bf16, stale, noise<std>, or a GGUF precision "
                     f"({', '.join(GGUF_PRECISIONS)})")


def correction_overrides(name: str) -> tuple[str, ...]:
    """The --set overrides that select correction `name` (a preset, or decoupled / a3po). Raises ValueError for an
    unknown name."""
    if name in SPECIAL_CORRECTIONS:
        return SPECIAL_CORRECTIONS[name]
    from nearpolicy.ops.correction_presets import CORRECTIONS

    if name not in CORRECTIONS.names():
        raise ValueError(f"unknown correction {name!r}; valid: {', '.join(SPECIAL_CORRECTIONS)} or a preset "
                         f"({', '.join(CORRECTIONS.names())})")
    return (f"correction.preset={name}", "correction.proximal=old")
