"""`nearpolicy export` beside a run that is still training: the run keeps its logging.keep_checkpoints newest and deletes
older ones as it saves, so the checkpoint export listed can vanish before its weights are read (issue 38 item 6:
"no model weights" for a folder just deleted). runs.export.read_checkpoint reads the weights at once and, without
--step, moves on to the newest checkpoint."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from nearpolicy.runs import export
from nearpolicy.runs.export import ExportError, read_checkpoint


def _checkpoint(run_dir: Path, step: int, value: float) -> Path:
    folder = run_dir / "checkpoints" / f"step_{step:06d}"
    folder.mkdir(parents=True)
    save_file({"w": torch.full((2,), value)}, str(folder / "model.safetensors"))
    return folder


def _rotating(monkeypatch, run_dir: Path, times: int = 1) -> None:
    """read_model_weights as seen while a run saves step k + 1 and deletes step k between the listing and the read."""
    real, calls = export.read_model_weights, []

    def read(checkpoint: Path):
        if len(calls) < times:
            calls.append(checkpoint)
            step = int(checkpoint.name.removeprefix("step_"))
            _checkpoint(run_dir, step + 1, float(step + 1))
            shutil.rmtree(checkpoint)
        return real(checkpoint)

    monkeypatch.setattr(export, "read_model_weights", read)
    monkeypatch.setattr(export.time, "sleep", lambda _: None)


def test_a_checkpoint_rotated_away_is_replaced_by_the_newest(tmp_path, monkeypatch):
    _checkpoint(tmp_path, 1, 1.0)
    _checkpoint(tmp_path, 2, 2.0)
    _rotating(monkeypatch, tmp_path)
    step, folder, weights = read_checkpoint(tmp_path)
    assert (step, folder.name) == (3, "step_000003") and weights["w"].tolist() == [3.0, 3.0]


def test_a_named_step_rotated_away_says_so(tmp_path, monkeypatch):
    _checkpoint(tmp_path, 2, 2.0)
    _rotating(monkeypatch, tmp_path)
    with pytest.raises(ExportError, match=r"checkpoint of step 2 .* was deleted while it was read: .*keep_checkpoints"):
        read_checkpoint(tmp_path, 2)


def test_a_run_saving_faster_than_export_reads_stops_after_three_tries(tmp_path, monkeypatch):
    _checkpoint(tmp_path, 1, 1.0)
    _rotating(monkeypatch, tmp_path, times=3)
    with pytest.raises(ExportError, match="deleted 3 times while it was read"):
        read_checkpoint(tmp_path)


def test_a_listed_checkpoint_without_weights_is_still_an_error(tmp_path):
    (tmp_path / "checkpoints" / "step_000001").mkdir(parents=True)  # not being deleted: no model.safetensors at all
    with pytest.raises(FileNotFoundError, match="no model weights at .*step_000001"):
        read_checkpoint(tmp_path)


def test_damaged_weights_name_the_newest_earlier_whole_checkpoint(tmp_path):
    """A newest checkpoint cut short (a kill, a full disk) is not exported silently from an older step: the error
    names the step to pass with --step (a whole weights-only checkpoint, as logging.final_weights_only writes)."""
    from nearpolicy.runs.folder import write_json

    older = _checkpoint(tmp_path, 1, 1.0)
    write_json(older / "trainer_state.json", {"step": 1, "weights_only": True})
    newest = _checkpoint(tmp_path, 2, 2.0) / "model.safetensors"
    newest.write_bytes(newest.read_bytes()[:-3])
    with pytest.raises(ExportError, match=r"weights of .*step_000002 cannot be read .*: the checkpoint is damaged; "
                                          r"the newest whole one is step 1 \(--step 1\)$"):
        read_checkpoint(tmp_path)
    assert read_checkpoint(tmp_path, 1)[0] == 1
