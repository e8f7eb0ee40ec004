"""`nearpolicy arena --adopt DIR` (arena/adopt.py): a cell another arena finished with the identical config is copied
in instead of run (folder, log, record, seconds), one differing in a key is refused naming the key and both values, a
non-final one is refused, a dry run writes nothing, DIR is never written, and a bad DIR is an ArenaError (exit 2).
Both arenas are the arena tests' (tests/test_arena.py), run with its fake `train`."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from nearpolicy.arena.adopt import adopt_into, read_other
from nearpolicy.arena.runner import run_arena
from nearpolicy.arena.spec import ArenaError, load_arena
from nearpolicy.arena.state import ArenaState
from nearpolicy.cli import main

from test_arena import ARENA, FINAL, FakeTrain, _arena  # noqa: E402  (the arena tests' 2 x 2 x 2 arena, fake train)

# this arena: the same cells with a third seed, and tis at another bound (its cells differ in correction.upper)
THIS = ARENA.replace("seeds = [0, 1]", "seeds = [0, 1, 2]").replace("correction.upper=3.0", "correction.upper=4.0")


def _tree_hash(folder: Path) -> str:
    """Every path under `folder` and every file's bytes, as one digest."""
    digest = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        digest.update(str(path.relative_to(folder)).encode())
        if path.is_file():
            digest.update(path.read_bytes())
    return digest.hexdigest()


@pytest.fixture
def other(tmp_path) -> Path:
    """The other arena's folder: every cell done but off/noise/s1 (failed: an infrastructure failure); its stored
    fingerprint of off/q8/s0 lacks a key added to the schema since (as an arena started by an older nearpolicy)."""
    (tmp_path / "other").mkdir()
    spec = load_arena(_arena(tmp_path / "other"), out=tmp_path / "other" / "out")
    assert run_arena(spec, say=lambda _: None, train=FakeTrain({"off/noise/s1": RuntimeError("disk on fire")})) == 1
    state = ArenaState.open(spec.out, spec)
    del state.arena["cells"]["off/q8/s0"]["algorithm"]["observation_loss_coef"]
    state.save()
    return spec.out


def _this(tmp_path: Path):
    (tmp_path / "this").mkdir()
    return load_arena(_arena(tmp_path / "this", THIS), out=tmp_path / "this" / "out")


def test_identical_cells_are_adopted_and_the_others_refused_with_the_reason(tmp_path, other, capsys):
    spec, before = _this(tmp_path), _tree_hash(other)
    assert main(["arena", str(spec.path), "--out", str(spec.out), "--adopt", str(other), "--page"]) == 0
    err = capsys.readouterr().err
    assert _tree_hash(other) == before  # DIR only read
    adopted = ["off/q8/s0", "off/q8/s1", "off/noise/s0"]
    assert [line.split(":")[0] for line in err.splitlines() if ": adopted from " in line] == [
        f"arena --adopt {cid}" for cid in adopted]
    assert f"arena --adopt off/noise/s1: not adopted from {other}: failed in {other}, not final" in err
    assert (f"arena --adopt tis/q8/s0: not adopted from {other}: config differs: correction.upper 3.0 -> 4.0 "
            f"({other}'s -> this arena's)") in err
    assert f"arena --adopt off/q8/s2: not adopted from {other}: not in {other}" in err
    assert err.count("not adopted") == 12 - 3  # every other pending cell: 1 not final, 4 differ, 4 not in DIR

    mine, theirs = ArenaState.open(spec.out, spec), ArenaState.open(other, load_arena(other.parent / "arena.toml",
                                                                                      out=other))
    for cid in adopted:
        assert mine.cells[cid] == theirs.cells[cid] and mine.cells[cid].status == "done"
        folder = cid.replace("/", "__")
        assert _tree_hash(spec.out / "cells" / folder) == _tree_hash(other / "cells" / folder)
        log = (spec.out / "logs" / f"{folder}.log").read_text()
        assert log.startswith((other / "logs" / f"{folder}.log").read_text()) and f"adopted from {other}" in log
    assert mine.seconds == pytest.approx(sum(theirs.cells[cid].seconds for cid in adopted), abs=1e-3)
    assert mine.counts()["done"] == 3 and mine.counts()["pending"] == 9

    cells = {c["id"]: c for c in json.loads((spec.out / "arena.json").read_text())["cells"]}  # the page reads them
    assert [cells[cid]["final_accuracy"] for cid in adopted] == [FINAL[cid] for cid in adopted]
    train = FakeTrain()
    assert run_arena(spec, say=lambda _: None, train=train) == 0
    assert sorted(c for c, _ in train.calls) == sorted(c.id for c in spec.cells if c.id not in adopted)
    assert _tree_hash(other) == before


def test_adopting_again_leaves_adopted_and_done_cells_alone(tmp_path, other):
    spec = _this(tmp_path)
    assert adopt_into(spec, [other], None, False, lambda _: None) == ["off/q8/s0", "off/q8/s1", "off/noise/s0"]
    said = []
    assert adopt_into(spec, [other, other], None, False, said.append) == []
    assert not any(line.startswith(("arena --adopt off/q8/s0", "arena --adopt off/q8/s1")) for line in said)  # done
    assert adopt_into(spec, [other], "tis/*", False, said.append) == []  # --only: only the selected cells


def test_a_dry_run_reports_what_would_be_adopted_and_writes_nothing(tmp_path, other, capsys):
    spec, before = _this(tmp_path), _tree_hash(other)
    assert main(["arena", str(spec.path), "--out", str(spec.out), "--adopt", str(other), "--dry-run"]) == 0
    captured = capsys.readouterr()
    assert captured.err.count(": would adopt from ") == 3 and ": adopted from " not in captured.err
    assert captured.out.count("pending") == 9 and captured.out.count(" adopt ") == 3  # listed, not counted to run
    assert "12 selected, 9 to run" in captured.out
    assert not spec.out.exists() and _tree_hash(other) == before


def test_a_non_empty_destination_is_refused(tmp_path, other):
    spec = _this(tmp_path)
    (spec.out / "cells" / "off__q8__s0").mkdir(parents=True)
    (spec.out / "cells" / "off__q8__s1").mkdir(parents=True)
    (spec.out / "cells" / "off__q8__s1" / "metrics.jsonl").write_text("")
    said = []
    assert adopt_into(spec, [other], "off/q8/*", False, said.append) == ["off/q8/s0"]  # an empty folder is fine
    assert any("off/q8/s1: not adopted" in line and "exists and is not empty" in line for line in said)
    assert (spec.out / "cells" / "off__q8__s1" / "metrics.jsonl").read_text() == ""


def test_a_bad_folder_is_an_arena_error(tmp_path, other, capsys):
    spec = _this(tmp_path)
    with pytest.raises(ArenaError, match="not an arena folder"):
        read_other(tmp_path / "missing")
    with pytest.raises(ArenaError, match="not an arena folder"):
        read_other(tmp_path / "this")  # a folder without arena-state.json
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "arena-state.json").write_text('{"format": 1, "cells": {}}')
    with pytest.raises(ArenaError, match=r"arena-state.json cannot be read \('arena'\)"):
        read_other(tmp_path / "broken")
    with pytest.raises(ArenaError, match="this arena's own folder"):
        adopt_into(spec, [spec.out], None, False, print)
    # the good folder first: nothing is adopted before every folder has been read
    assert main(["arena", str(spec.path), "--out", str(spec.out), "--adopt", str(other), "--adopt",
                 str(tmp_path / "broken"), "--page"]) == 2
    assert "error: --adopt " in capsys.readouterr().err and not spec.out.exists()


def test_a_record_with_fields_of_the_wrong_type_is_refused_before_anything_is_copied(tmp_path):
    import json

    from nearpolicy.arena.adopt import read_other
    from nearpolicy.arena.spec import ArenaError

    folder = tmp_path / "other"
    (folder / "cells" / "off__q4_1__s0").mkdir(parents=True)
    state = {"format": 1, "arena": {"base": "b", "cells": {"off/q4_1/s0": {}}}, "seconds": 1.0,
             "cells": {"off/q4_1/s0": {"status": "done", "seconds": "abc", "attempts": 1}}}
    (folder / "arena-state.json").write_text(json.dumps(state))
    with pytest.raises(ArenaError, match="wrong type"):
        read_other(folder)
    state["cells"]["off/q4_1/s0"] |= {"seconds": 5.0, "attempts": "x"}
    (folder / "arena-state.json").write_text(json.dumps(state))
    with pytest.raises(ArenaError, match="wrong type"):
        read_other(folder)
    state["cells"]["off/q4_1/s0"]["attempts"] = 1
    (folder / "arena-state.json").write_text(json.dumps(state))
    assert read_other(folder).records["off/q4_1/s0"].seconds == 5.0


def test_an_arena_whose_own_state_has_a_record_of_the_wrong_type_is_refused(tmp_path):
    """The same typed read (state.read_record) serves the arena's own state: a damaged record is an ArenaError."""
    from nearpolicy.arena.state import fingerprint

    spec = load_arena(_arena(tmp_path), tmp_path / "out")
    cell = spec.cells[0].id
    state = {"format": 1, "arena": fingerprint(spec), "seconds": 0.0,
             "cells": {cell: {"status": "done", "seconds": "abc", "attempts": 1}}}
    spec.out.mkdir(parents=True, exist_ok=True)
    (spec.out / "arena-state.json").write_text(json.dumps(state))
    with pytest.raises(ArenaError, match="wrong type"):
        ArenaState.open(spec.out, spec)
