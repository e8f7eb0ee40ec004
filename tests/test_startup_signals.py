"""A run's start-up, before the first step (issue 38 item 8): SIGTERM while the model loads ended the process with
exit 143 and no word; Ctrl-C while `nearpolicy train` imported torch printed a traceback; a wandb that cannot start
was found only once the model and engine were up. Each now ends with one line saying what stopped it (exit 128 + the
signal) or is refused before anything loads. The signals are sent in child processes: a SIGTERM that nothing catches
would end the test session itself."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from nearpolicy.config.schema import load_config
from nearpolicy.runs.trackers import TrackerError, check_trackers


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)


def test_sigterm_while_the_trainer_is_built_says_so_and_exits_143():
    done = _python("""
        import os, signal
        import nearpolicy.training.trainer as trainer
        from nearpolicy.config.schema import Config
        from nearpolicy.training.run import build_trainer

        def open_trainer(cfg, resume, log):  # the model is loading when the signal comes
            os.kill(os.getpid(), signal.SIGTERM)
            raise AssertionError("the start-up went on after SIGTERM")

        trainer.open_trainer = open_trainer
        print(build_trainer(Config(), False, print))
        print(signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)  # the default handler is back
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-2:] == [
        "(None, (143, 'stopped by SIGTERM during startup; nothing was trained'))", "True"]


@pytest.mark.parametrize("how, code, said", [("signal.raise_signal(signal.SIGTERM)", 143, "stopped by SIGTERM"),
                                              ("raise KeyboardInterrupt", 130, "interrupted")])
def test_a_stop_while_train_imports_and_reads_its_config_is_one_line(how, code, said):
    done = _python(f"""
        import signal, sys
        import nearpolicy.cli as cli

        def reading(args):  # `nearpolicy train` importing torch and reading the config
            {how}

        cli._train_config = reading
        sys.exit(cli.main(["train"]))
    """)
    assert done.returncode == code
    assert done.stderr.strip().splitlines() == [f"{said} during startup; nothing was trained"]  # no traceback


def test_tracker_failures_are_found_before_anything_loads(tmp_path, monkeypatch):
    import wandb

    from nearpolicy.training.trainer import open_trainer

    monkeypatch.setattr(wandb, "login", lambda **kwargs: False)  # no credentials configured
    cfg = load_config(None, [f"run.output_dir='{tmp_path}'", "logging.wandb=true", "logging.wandb_mode=online"])
    built = []
    with pytest.raises(TrackerError, match=r"wandb_mode = 'online' needs wandb credentials .*wandb login"):
        open_trainer(cfg, log=lambda _: None, build=lambda *a: built.append(a))
    assert built == [] and not (tmp_path / cfg.run.name).exists()  # refused before the build, no folder left
    check_trackers(load_config(None, ["logging.wandb=true"]).logging)  # offline needs no credentials
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed
    with pytest.raises(TrackerError, match="needs the wandb package"):
        check_trackers(cfg.logging)
