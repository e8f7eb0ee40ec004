"""Files and folders nearpolicy publishes by rename get the mode a plain open() / mkdir() would give (the model
cache, run files, exports): mkstemp's 0600 and mkdtemp's 0700 must not leak into them (a cached model other users
of the machine could not read)."""

from __future__ import annotations

import os
import stat

import pytest

from nearpolicy.files import atomic_path, plain_mode, write_atomically


@pytest.fixture
def umask_027():
    previous = os.umask(0o027)
    yield
    os.umask(previous)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_a_new_file_gets_the_umasks_mode_and_an_existing_one_keeps_its_own(tmp_path, umask_027):
    assert plain_mode(folder=False) == 0o640 and plain_mode(folder=True) == 0o750
    fresh = tmp_path / "fresh.json"
    write_atomically(fresh, "{}")
    assert _mode(fresh) == 0o640
    kept = tmp_path / "kept.json"
    kept.write_text("old")
    os.chmod(kept, 0o604)
    with atomic_path(kept, durable=True) as tmp:
        tmp.write_text("new")
    assert kept.read_text() == "new" and _mode(kept) == 0o604


def test_a_failed_write_leaves_the_target_and_its_mode(tmp_path, umask_027):
    target = tmp_path / "t.txt"
    target.write_text("old")
    os.chmod(target, 0o600)
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("disk gone")
    assert target.read_text() == "old" and _mode(target) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["t.txt"]


def test_a_checkpoint_folder_and_its_safetensors_files_get_plain_modes(tmp_path, umask_027):
    """safetensors' save_file creates its files 0600 whatever the umask; checkpoints are published with plain modes."""
    import torch

    from nearpolicy.runs.folder import save_checkpoint

    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    path = save_checkpoint(tmp_path, 1, model, optimizer, {}, keep=1)
    files = [p for p in path.rglob("*") if p.is_file()]
    assert any(p.suffix == ".safetensors" for p in files)
    assert _mode(path) == 0o750 and {p.name: _mode(p) for p in files} == {p.name: 0o640 for p in files}
