"""Command line: `nearpolicy train [CONFIG.toml] [--set key=value ...] [--resume] [--dry-run]`, `nearpolicy train
--resume RUN_DIR [--set ...]`, `nearpolicy list [NAME]`, `nearpolicy config`, `nearpolicy summary RUN_DIR`,
`nearpolicy report RUN_DIR [-o OUT.html]`, `nearpolicy compare RUN_DIR RUN_DIR... [-o OUT.html]`,
`nearpolicy diagnose [CONFIG] [--candidates SPEC ...]`, `nearpolicy diagnose [CONFIG] --endpoint URL [--model MODEL]`,
`nearpolicy arena ARENA.toml [--out DIR] [--dry-run] [--workers N] [--adopt DIR]
[--only CELL_GLOB] [--page]`, `nearpolicy gradbias [CONFIG] [--sources ...] [--corrections ...]`, `nearpolicy export RUN_DIR [--step N] [--out DIR]
[--gguf PRECISION ...]`, `nearpolicy doctor`, `nearpolicy --version`."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def _load_config(args: argparse.Namespace):
    """The validated config of `args.config` + `--set`, or None after printing the error (exit code 2)."""
    from nearpolicy.config.schema import ConfigError, load_config

    try:
        return load_config(args.config, args.set or [])
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return None


def _train_config(args: argparse.Namespace):
    """(the validated config, resume?) of `train`'s arguments, or None after printing the error (exit code 2).
    `--resume RUN_DIR` (or `train RUN_DIR --resume`) reads the run's own config.json, --set on top; `--resume`
    alone resumes the run folder CONFIG + --set names; `--resume CONFIG.toml` is CONFIG with --resume. A run folder's
    own config.json as CONFIG starts a new run from that run's config (runs.start_checks.config_from_run); with
    --resume it is --resume of its folder."""
    from nearpolicy.config.schema import ConfigError, load_config
    from nearpolicy.runs.start_checks import config_from_run, is_run_config, stored_config

    config, run_dir = args.config, None
    if isinstance(args.resume, str):
        if config is None and Path(args.resume).is_file():  # `train --resume CONFIG.toml`: the flag came first
            config = Path(args.resume)
        else:
            run_dir = Path(args.resume)
    try:
        if config is not None and config.is_dir():
            if args.resume is None:
                from nearpolicy.signals import resume_command

                raise ConfigError(f"{config} is a folder, not a config file; to continue the run in it: "
                                  f"{resume_command(config)}")
            if run_dir is not None:
                raise ConfigError(f"two run folders given: {config} and --resume {run_dir}")
            config, run_dir = None, config
        if config is not None and run_dir is None and is_run_config(config):  # a run folder's own config.json
            if args.resume is None:
                return config_from_run(config.parent, args.set or []), False  # a new run beside it, its paths kept
            config, run_dir = None, config.parent  # --resume RUN/config.json is --resume RUN
        if run_dir is None:
            return load_config(config, args.set or []), args.resume is not None
        if config is not None:
            raise ConfigError(f"give CONFIG or --resume RUN_DIR, not both (--resume {run_dir} reads the run's own "
                              "config.json; change keys with --set)")
        if not run_dir.is_dir():
            raise ConfigError(f"--resume {run_dir}: no such run folder")
        return stored_config(run_dir, args.set or []), True
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return None


def _train(args: argparse.Namespace) -> int:
    from nearpolicy.signals import StartupInterrupt, startup_stop

    try:
        with StartupInterrupt():  # Ctrl-C / SIGTERM while importing and reading the config: a line, not a traceback
            loaded = _train_config(args)
            if loaded is None:
                return 2
            cfg, resume = loaded
            if args.dry_run:
                from nearpolicy.training.run import dry_run

                code, text, message = dry_run(cfg, resume)
                print(text, end="")
                print(message, file=sys.stderr)
                return code
            from nearpolicy.api import run_training
    except KeyboardInterrupt as err:
        code, message = startup_stop(err)
        print(message, file=sys.stderr)
        return code
    code, message = run_training(cfg, resume)
    if message:
        print(message, file=sys.stderr)
    return code


LIST_WIDTH = 100  # `nearpolicy list` lines fit a terminal this wide


def _registries():
    from nearpolicy.ops.advantages import ADVANTAGES
    from nearpolicy.ops.correction_presets import CORRECTIONS
    from nearpolicy.ops.data_policies import DATA_POLICIES
    from nearpolicy.ops.kl import KL_ESTIMATORS
    from nearpolicy.ops.losses import POLICY_LOSSES
    from nearpolicy.ops.mixture import MIXTURES
    from nearpolicy.ops.popo import REPLAY_RULES
    from nearpolicy.ops.turn_credit import TURN_CREDIT
    from nearpolicy.ops.xrpo import ADVANTAGE_TRANSFORMS, ROLLOUT_ALLOCATORS

    # a KL estimator's summary: its gradient
    return (ADVANTAGES, POLICY_LOSSES, KL_ESTIMATORS, CORRECTIONS, TURN_CREDIT, DATA_POLICIES, REPLAY_RULES,
            ADVANTAGE_TRANSFORMS, ROLLOUT_ALLOCATORS, MIXTURES)


def _list(args: argparse.Namespace) -> int:
    import textwrap

    if args.name:
        return _list_entry(args.name)
    for registry in _registries():
        family = registry.family
        print(f"{family[:-1] + 'ies' if family.endswith('y') else family + ('es' if family.endswith('s') else 's')}:")
        for entry in registry:
            head = f"  {entry.name:<28} "
            print(head + textwrap.shorten(entry.summary, LIST_WIDTH - len(head), placeholder=" ..."))
    print("\n`nearpolicy list NAME`: a name's full summary, source and definition")
    return 0


def _list_entry(name: str) -> int:
    """Every registry entry called `name`: its family, summary and source in full, and its definition (a
    correction's composed spec; a loss's docstring)."""
    import inspect
    import textwrap

    from nearpolicy.ops.correction_presets import CORRECTIONS, describe_correction
    from nearpolicy.registry import did_you_mean

    found = [(registry, entry) for registry in _registries() for entry in registry if entry.name == name]
    if not found:
        names = {entry.name for registry in _registries() for entry in registry}
        print(f"error: no registered name {name!r}{did_you_mean(name, names)}; `nearpolicy list` lists them",
              file=sys.stderr)
        return 2
    wrap = lambda text: textwrap.fill(" ".join(text.split()), LIST_WIDTH, initial_indent="  ",  # noqa: E731
                                      subsequent_indent="  ", break_on_hyphens=False)
    for registry, entry in found:
        print(f"{registry.family} {entry.name}\n{wrap(entry.summary)}\n{wrap('source: ' + entry.source)}")
        if registry is CORRECTIONS:
            spec = entry.fn()
            print(wrap(f"computes: {describe_correction(entry.name, spec)}") + "\n" + wrap(f"spec: {spec!r}"))
        elif inspect.getdoc(entry.fn):
            print(textwrap.indent(inspect.getdoc(entry.fn), "  "))
    return 0


def _config(args: argparse.Namespace) -> int:
    from nearpolicy.config.reference import config_reference

    print(config_reference(), end="")
    return 0


def _summary(args: argparse.Namespace) -> int:
    from nearpolicy.runs.folder import RunFolderError
    from nearpolicy.runs.summary import summarize

    try:
        print(summarize(args.run_dir, warn=lambda warning: print(f"warning: {warning}", file=sys.stderr)))
    except RunFolderError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def _write_report(run_dirs: list[Path], out: Path) -> int:
    from nearpolicy.runs.report import ReportError, write_report

    try:
        warnings = write_report(run_dirs, out)
    except ReportError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    print(f"wrote {out}", file=sys.stderr)
    return 0


def _report(args: argparse.Namespace) -> int:
    return _write_report([args.run_dir], args.output or args.run_dir / "report.html")


def _compare(args: argparse.Namespace) -> int:
    return _write_report(args.run_dirs, args.output)


def _diagnose(args: argparse.Namespace) -> int:
    from nearpolicy.diagnosis.run import DiagnoseSettings, markdown_table, run_diagnosis
    from nearpolicy.engines.base import EngineError

    if args.endpoint:  # a running server instead of engines nearpolicy starts
        from nearpolicy.diagnosis.endpoint_command import endpoint_command

        return endpoint_command(args)
    cfg = _load_config(args)
    if cfg is None:
        return 2
    settings = DiagnoseSettings(
        candidates=args.candidates or DiagnoseSettings().candidates, prompts=args.prompts, group_size=args.group,
        out=args.out, weights=args.weights, budget_k3=args.budget_k3, budget_floor_multiple=args.budget_floor_multiple,
        budget_seq_ess=args.budget_seq_ess, sensitivity=args.sensitivity or [], propose=args.propose,
        promote_to=args.promote_to, sensitivity_prompts=args.sensitivity_prompts, progress=cfg.logging.progress)
    try:
        report, code = run_diagnosis(cfg, settings, log=lambda msg: print(msg, file=sys.stderr))
    except (ValueError, OSError, EngineError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    rejected = sum(not c["admitted"] for c in report["candidates"])
    if args.json:
        from nearpolicy.runs.folder import write_json

        write_json(args.json, report)
    print(markdown_table(report))  # the table and verdicts on stdout (`> table.md`); progress and logs on stderr
    print("\nevery candidate admitted" if not rejected else
          f"\n{rejected} of {len(report['candidates'])} candidate(s) rejected")
    print(f"wrote {args.out / 'diagnose.json'}, .csv and position.png", file=sys.stderr)
    return code


def _add_diagnose(sub) -> None:
    from nearpolicy.engines.gguf.export import TENSOR_PRECISIONS

    d = sub.add_parser("diagnose", help="measure engine/trainer mismatch of rollout configurations; admission check",
                       description="Sample responses from each candidate rollout configuration, recompute the "
                       "trainer's log-probs and admit or reject each against a k3 budget calibrated on the noise "
                       "floor (trainer vs the f32 engine). The table and a verdict line per candidate go to stdout, "
                       "progress and logs to stderr. Exit 0 when every candidate is admitted, 1 when one is rejected, "
                       "2 when there is no verdict (a bad option or config, an engine or server that fails).")
    d.add_argument("config", type=Path, nargs="?", help="TOML config for model, task and sampling (default: embedded)")
    d.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key")
    d.add_argument("--candidates", nargs="+", metavar="SPEC",
                   help="e.g. llamacpp:q4_1 llamacpp:q4_1,blk.0-2=f16 hf:bf16 llamacpp:f16,temperature=0.7 "
                   "(default: llamacpp f32 f16 q8_0 q4_1 mxfp4 and hf:bf16)")
    d.add_argument("--prompts", type=int, default=16, help="task prompts to sample (default 16)")
    d.add_argument("--group", type=int, default=4, help="samples per prompt (default 4)")
    d.add_argument("--out", type=Path, default=Path("runs/diagnose"), help="output folder (default runs/diagnose)")
    d.add_argument("--weights", type=Path, help="checkpoint folder (or .safetensors) replacing model.path's weights")
    budget = d.add_mutually_exclusive_group()
    budget.add_argument("--budget-k3", type=float, help="absolute k3 budget, nats/token")
    budget.add_argument("--budget-floor-multiple", type=float, help="budget = this multiple of the noise floor's k3")
    d.add_argument("--budget-seq-ess", type=float, default=0.5,
                   help="default budget: sequence ESS >= this at sampling.max_new_tokens tokens (default 0.5)")
    d.add_argument("--sensitivity", nargs="+", metavar="PRECISION", choices=TENSOR_PRECISIONS,
                   help="per-layer sensitivity scan at these GGUF precisions (bar chart PNG)")
    d.add_argument("--sensitivity-prompts", type=int, default=8,
                   help="prompts (x --group samples) the sensitivity scan scores by teacher forcing (default 8)")
    d.add_argument("--propose", action="store_true",
                   help="for each rejected llamacpp candidate, search the cheapest mixed-precision recipe that passes")
    d.add_argument("--promote-to", default="f16", choices=TENSOR_PRECISIONS,
                   help="precision of promoted units (default f16)")
    from nearpolicy.diagnosis.endpoint_command import add_endpoint_arguments

    add_endpoint_arguments(d)
    d.set_defaults(func=_diagnose)


def _export(args: argparse.Namespace) -> int:
    from nearpolicy.engines.base import EngineError
    from nearpolicy.runs.export import export_run

    log = lambda msg: print(msg, file=sys.stderr)  # noqa: E731
    try:
        done = export_run(args.run_dir, args.step, args.out, args.gguf, args.force, log=log)
    except (ValueError, FileNotFoundError) as err:  # no run, checkpoint or model.path; --step or --out refused
        print(f"error: {err}", file=sys.stderr)
        return 2
    except (OSError, EngineError) as err:  # EngineError: llama.cpp's K-quant quantizer failed
        print(f"error: {err} (nothing was written at the output folder)", file=sys.stderr)
        return 1
    log(f"wrote {done.folder} (step {done.step}): AutoModelForCausalLM.from_pretrained('{done.folder}') loads it"
        + ("".join(f"; llama.cpp runs {path}" for path in done.ggufs) or "; no GGUF written (--gguf with no precision)"))
    return 0


def _add_export(sub) -> None:
    from nearpolicy.engines.gguf.export import PRECISIONS

    e = sub.add_parser("export", help="a run's checkpoint as a Hugging Face model folder and GGUF files",
                       description="Write a checkpoint's weights as a Hugging Face folder (model.safetensors, "
                       "config.json, tokenizer) that transformers loads, with GGUF files for llama.cpp in it.")
    e.add_argument("run_dir", type=Path)
    e.add_argument("--step", type=int, help="the checkpoint's step (default: the last checkpoint)")
    e.add_argument("--out", type=Path, help="output folder (default RUN_DIR/export/step_XXXXXX)")
    e.add_argument("--gguf", nargs="*", metavar="PRECISION", choices=PRECISIONS,
                   help="GGUF precisions to write (default: the run's engine.precision; --gguf alone: none)")
    e.add_argument("--force", action="store_true", help="replace a non-empty output folder")
    e.set_defaults(func=_export)


def _doctor(args: argparse.Namespace) -> int:
    from nearpolicy.doctor import doctor

    return doctor(args.runs, probe=not args.no_probe)


def _version() -> str:
    from nearpolicy import __version__

    return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nearpolicy", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    parser.add_argument("--version", action="version", version=f"nearpolicy {_version()}")
    train = sub.add_parser("train", help="run GRPO training from a TOML config")
    train.add_argument("config", type=Path, nargs="?", help="TOML config (omit for the embedded defaults)")
    train.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key, e.g. run.steps=5")
    train.add_argument("--resume", nargs="?", const=True, metavar="RUN_DIR",
                       help="continue from the run folder's last checkpoint; with RUN_DIR, the run's own config.json "
                       "is the config (no CONFIG needed; --set applies on top, e.g. run.steps=60)")
    train.add_argument("--dry-run", action="store_true", help="print the effective config (TOML) and the run plan, "
                       "check the run folder, and exit without loading the model or writing anything")
    train.set_defaults(func=_train)
    lister = sub.add_parser("list", help="list registered advantage estimators, losses, KL estimators, corrections, "
                                         "turn credit, data policies, group replay, XRPO's pieces and task mixtures")
    lister.add_argument("name", nargs="?", help="show one name in full: summary, source, definition")
    lister.set_defaults(func=_list)
    sub.add_parser("config", help="every config key with its default, range or choices, and what it does").set_defaults(
        func=_config)
    summary = sub.add_parser("summary", help="markdown summary of a run folder (accuracy, mismatch, timings)",
                             description="Print a run folder's markdown summary: the eval accuracy at each eval, "
                                         "min / median / mean / max of the reward, mismatch (k3, ESS, ...) and time "
                                         "metrics, and the training time.")
    summary.add_argument("run_dir", type=Path, help="a run folder (runs/<run.name>), finished or not")
    summary.set_defaults(func=_summary)
    report = sub.add_parser("report", help="self-contained HTML report of a run folder (plots of every logged metric)")
    report.add_argument("run_dir", type=Path)
    report.add_argument("-o", "--output", type=Path, help="HTML file to write (default RUN_DIR/report.html)")
    report.set_defaults(func=_report)
    compare = sub.add_parser("compare", help="self-contained HTML report overlaying several run folders")
    compare.add_argument("run_dirs", type=Path, nargs="+", metavar="run_dir")
    compare.add_argument("-o", "--output", type=Path, default=Path("runs/compare.html"),
                         help="HTML file to write (default runs/compare.html)")
    compare.set_defaults(func=_compare)
    _add_diagnose(sub)
    _add_export(sub)
    from nearpolicy.arena.command import add_arena_parser

    add_arena_parser(sub)
    from nearpolicy.gradbias.command import add_gradbias_parser

    add_gradbias_parser(sub)
    doc = sub.add_parser("doctor", help="what a bug report needs: CPU flags, llama.cpp features and probe, torch "
                         "GEMM speed, disk, Chromium; exit 1 when a required piece is missing")
    doc.add_argument("--runs", type=Path, default=Path("runs"), help="where checkpoints go (free disk is measured there)")
    doc.add_argument("--no-probe", action="store_true", help="skip the llama.cpp startup probes (child processes)")
    doc.set_defaults(func=_doctor)
    return parser


def main(argv: list[str] | None = None) -> int:
    import faulthandler

    if not faulthandler.is_enabled():  # a native crash that still reaches this process prints a Python stack
        faulthandler.enable()
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # output cut short by a closed pipe (`nearpolicy list | head`): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
