"""`nearpolicy diagnose --endpoint URL [--model MODEL] ...`: the command-line side of diagnosis/endpoint.py.

Exit status (a CI gate, docs/diagnose.md): 0 admitted, 1 rejected (k3 over the budget, or a failed check), 2 no
verdict (a bad option or config, an unreachable server, a timeout, no log-probs, a different tokenizer, a truncated
or malformed answer, or an unexpected error: cause "internal", never exit 1). `--json PATH` gets the report, or on
exit 2 `{"verdict": null, "error": {"cause": ..., "message": ...}}`."""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

LOCAL_ONLY = ("candidates", "sensitivity", "propose", "budget_floor_multiple")


def add_endpoint_arguments(parser: argparse.ArgumentParser) -> None:
    """The endpoint options of `diagnose`, and `--json` (both modes)."""
    g = parser.add_argument_group("a running server", "measure an OpenAI-compatible /v1/completions server (vLLM, "
                                  "llama-cpp-python, SGLang, ...) against the trainer's model instead of engines "
                                  "nearpolicy starts (docs/diagnose.md). Exit 0 admitted, 1 rejected, 2 no verdict.")
    g.add_argument("--endpoint", metavar="URL", help="the server's base URL, e.g. http://127.0.0.1:8000 (or .../v1)")
    g.add_argument("--model", metavar="HF_OR_GGUF", help="the reference model the trainer scores with "
                   "(model.path: 'smollm2', a .gguf, dequantized to fp32, or an HF folder; default the config's)")
    g.add_argument("--served-model", metavar="NAME", help="the request's `model` (default: the first the server lists)")
    g.add_argument("--logprobs-mode", choices=("raw", "processed"), default="raw",
                   help="what the server's log-probs are: raw (log softmax of the logits; OpenAI, vLLM's default, "
                   "llama-cpp-python) or processed (after temperature / top-k / top-p: vLLM --logprobs-mode "
                   "processed_logprobs). Default raw")
    g.add_argument("--top-logprobs", type=int, default=5,
                   help="top log-probs asked per token for the full-distribution check, 0-20 (default 5)")
    g.add_argument("--timeout", type=float, default=120.0,
                   help="seconds per request, wall clock: headers and body (default 120)")
    g.add_argument("--concurrency", type=int, default=4, help="requests in flight (default 4)")
    g.add_argument("--api-key-env", metavar="VAR", help="environment variable holding the server's API key")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the JSON report to PATH")


def _write_json(path: Path | None, data: dict) -> None:
    if path is not None:
        from nearpolicy.files import write_atomically

        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, json.dumps(data, indent=2, allow_nan=False) + "\n")


def _fail(args: argparse.Namespace, message: str, cause: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    _write_json(args.json, {"kind": "endpoint", "endpoint": args.endpoint, "verdict": None, "admitted": None,
                            "exit_code": 2, "error": {"cause": cause, "message": message}})
    return 2


def endpoint_command(args: argparse.Namespace) -> int:
    """Run `diagnose --endpoint` from parsed arguments; returns the exit status (module docstring)."""
    from nearpolicy.config.schema import ConfigError, load_config
    from nearpolicy.diagnosis.endpoint import EndpointSettings, api_key_from_env, run_endpoint_diagnosis
    from nearpolicy.diagnosis.endpoint_client import EndpointError
    from nearpolicy.diagnosis.endpoint_report import endpoint_markdown
    from nearpolicy.diagnosis.run import DiagnoseSettings

    given = [f"--{name.replace('_', '-')}" for name in LOCAL_ONLY if getattr(args, name, None)]
    if given:
        return _fail(args, f"{', '.join(given)}: not with --endpoint (they choose engines nearpolicy starts)", "usage")
    overrides = list(args.set or []) + ([f"model.path={json.dumps(str(args.model))}"] if args.model else [])
    try:
        cfg = load_config(args.config, overrides)
        diagnose = DiagnoseSettings(prompts=args.prompts, group_size=args.group, out=args.out, weights=args.weights,
                                    budget_k3=args.budget_k3, budget_seq_ess=args.budget_seq_ess,
                                    progress=cfg.logging.progress)
        settings = EndpointSettings(args.endpoint, args.served_model, args.logprobs_mode, args.top_logprobs,
                                    args.timeout, args.concurrency, api_key_from_env(args.api_key_env), diagnose)
        report, code = run_endpoint_diagnosis(cfg, settings, log=lambda msg: print(msg, file=sys.stderr))
    except ConfigError as err:
        return _fail(args, str(err), "config")
    except EndpointError as err:
        return _fail(args, f"{err} (no verdict: nothing was measured in full)", err.cause)
    except (ValueError, OSError) as err:
        return _fail(args, str(err), "usage")
    except Exception as err:  # noqa: BLE001 - a bug must not read as exit 1 ("rejected") to a CI gate
        traceback.print_exc()
        return _fail(args, f"{type(err).__name__}: {err} (an unexpected error, traceback above)", "internal")
    from nearpolicy.runs.folder import write_json

    Path(args.out).mkdir(parents=True, exist_ok=True)
    write_json(Path(args.out) / "endpoint.json", report)
    _write_json(args.json, report)
    print(endpoint_markdown(report))
    print(f"\nendpoint {report['verdict']}")
    print(f"wrote {Path(args.out) / 'endpoint.json'}" + (f" and {args.json}" if args.json else ""), file=sys.stderr)
    return code
