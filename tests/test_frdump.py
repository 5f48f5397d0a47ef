"""The flight-recorder dump (peerwatch.hangs.frdump), without torch: the groups added to a
pickled dump without unpickling it, what is written where, failures said once, and the
report's ``flight_recorder`` entry. The real thing, read by torch's analyzer, is
tests/test_fr_evidence.py."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import types
from pathlib import Path
from typing import Any, Dict

import jsonschema
import pytest

from peerwatch.core.records import Diagnosis
from peerwatch.hangs import frdump
from peerwatch.rundir.rundir import FLIGHT_RECORDER, TMP, RunDir, fr_dump_name, parse_fr_dump_name
from peerwatch.verdict import report as _report

SCHEMA = json.loads((Path(__file__).parents[1] / "peerwatch" / "schemas" / "report-v1.schema.json").read_text())
UNNAMED = {"": {"name": "", "desc": "", "ranks": "[0, 1, 2]"}}  # what torch 2.13's gloo recorder says
WORLD = {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2]"},
         "1": {"name": "1", "desc": "pairs", "ranks": "[2, 0]"}}


def torch_like_dump(config: Dict[str, Any], protocol: int = 2) -> bytes:
    """A dump shaped as torch's: a dict first, entries that share objects (memo references)."""
    group = ("0", "default_pg")
    entries = [{"process_group": group, "collective_seq_id": i, "profiling_name": "gloo:all_reduce",
                "input_sizes": [[4]], "state": "completed"} for i in range(1, 50)]
    return pickle.dumps({"version": "2.10", "pg_config": config, "pg_status": {}, "entries": entries},
                        protocol=protocol)


def test_the_groups_torch_did_not_name_are_added_and_marked_without_touching_the_entries() -> None:
    data = torch_like_dump(UNNAMED)
    out = frdump.with_groups(data, UNNAMED, WORLD)
    assert out.startswith(data[:-1]) and len(out) - len(data) < 400  # continued, not pickled again
    body, before = pickle.loads(out), pickle.loads(data)
    assert body["pg_config"] == WORLD  # the unnamed group (the last one made, under no name) goes
    assert body["entries"] == before["entries"] and body["version"] == "2.10"
    assert body["peerwatch"]["pg_config_added"] == ["0", "1"] and "did not name" in body["peerwatch"]["why"]


def test_a_stream_of_another_shape_is_unpickled_and_pickled_to_the_same_answer() -> None:
    data = torch_like_dump(UNNAMED, protocol=5)
    body = pickle.loads(frdump.with_groups(data, UNNAMED, WORLD))
    assert body["pg_config"] == WORLD and body["entries"] == pickle.loads(data)["entries"]


def test_a_dump_that_names_its_groups_is_written_as_torch_made_it() -> None:
    data = torch_like_dump(WORLD)
    assert frdump.with_groups(data, WORLD, WORLD) is data
    assert frdump.missing_groups(WORLD, {}) is None
    # A group torch named is never replaced by what Python says of it.
    mine = {"0": {"name": "0", "desc": "from torch", "ranks": "[0, 1, 2]"}}
    assert frdump.missing_groups(mine, WORLD) == {**mine, "1": WORLD["1"]}


def test_dump_names_are_what_the_analyzer_takes_apart() -> None:
    # fr_trace's loader: the prefix common to the folder's files, then the rank.
    assert fr_dump_name(3) == "rank_3" and parse_fr_dump_name("rank_3") == 3
    assert parse_fr_dump_name("rank_") is None and parse_fr_dump_name("rank-00003.json") is None


@pytest.fixture
def run_dir(tmp_path: Path) -> RunDir:
    path = tmp_path / "run"
    (path / TMP).mkdir(parents=True, mode=0o700)
    return RunDir(str(path))


def fake_torch(monkeypatch: pytest.MonkeyPatch, **dumps: Any) -> None:
    module = types.SimpleNamespace(**dumps)
    monkeypatch.setattr(frdump, "c10d", lambda: module)
    monkeypatch.setattr(frdump, "_groups", lambda: dict(WORLD))


def recorder(config: Dict[str, Any]):
    def dump(includeCollectives: bool, includeStackTraces: bool, onlyActive: bool) -> bytes:
        assert not includeStackTraces and not onlyActive  # a first dump with stacks costs seconds
        body = pickle.loads(torch_like_dump(config))
        if not includeCollectives:
            del body["entries"]
        body["pg_status"] = {"0": {"last_enqueued_collective": 49}}
        return pickle.dumps(body, protocol=2)
    return dump


def test_a_rank_writes_its_dump_once_per_diagnosis_and_at_its_teardown(run_dir, monkeypatch) -> None:
    calls = []
    dump = recorder(UNNAMED)
    fake_torch(monkeypatch, _dump_fr_trace=lambda **kw: calls.append(kw) or dump(**kw))
    fr = frdump.FlightRecorderDump(run_dir, 3)
    d = Diagnosis(finding="hang", laggards=(1,), entered=(0,), since_ns=1, stalled_at_ns=1, time_ns=5, made_by=0,
                  detail="")
    fr.on_diagnosis(d)
    fr.on_diagnosis(d)  # seen again on the next look: not dumped again
    fr.on_diagnosis(dataclasses.replace(d, resolved_ns=9))  # resolved: the job moved
    assert len(calls) == 2  # the groups, then the entries
    path = Path(run_dir.path, FLIGHT_RECORDER, fr_dump_name(3))
    assert pickle.loads(path.read_bytes())["pg_config"] == WORLD
    assert fr.dump("teardown") and len(calls) == 4
    assert os.listdir(Path(run_dir.path, FLIGHT_RECORDER)) == ["rank_3"]  # nothing else: the analyzer reads all
    assert oct(os.stat(Path(run_dir.path, FLIGHT_RECORDER)).st_mode & 0o777) == "0o700"


def test_nccls_recorder_is_taken_where_it_has_groups_and_gloos_where_it_has_none(run_dir, monkeypatch) -> None:
    empty = lambda **kw: pickle.dumps({"version": "2.10", "pg_config": {}, "pg_status": {}, "entries": []})  # noqa: E731
    fake_torch(monkeypatch, _dump_nccl_trace=empty, _dump_fr_trace=recorder(UNNAMED))
    assert frdump.FlightRecorderDump(run_dir, 0).dump("teardown")
    assert len(pickle.loads(Path(run_dir.path, FLIGHT_RECORDER, "rank_0").read_bytes())["entries"]) == 49
    fake_torch(monkeypatch, _dump_nccl_trace=recorder(WORLD), _dump_fr_trace=empty)
    assert frdump.FlightRecorderDump(run_dir, 0).dump("teardown")
    body = pickle.loads(Path(run_dir.path, FLIGHT_RECORDER, "rank_0").read_bytes())
    assert len(body["entries"]) == 49 and "peerwatch" not in body  # NCCL's names its groups: as torch made it


def test_nothing_is_written_without_torch_distributed_or_a_process_group(run_dir, monkeypatch) -> None:
    monkeypatch.setattr(frdump, "c10d", lambda: None)
    assert not frdump.FlightRecorderDump(run_dir, 0).dump("teardown")
    fake_torch(monkeypatch, _dump_fr_trace=lambda **kw: pickle.dumps({"pg_config": {}, "pg_status": {}}))
    assert not frdump.FlightRecorderDump(run_dir, 0).dump("teardown")
    assert not Path(run_dir.path, FLIGHT_RECORDER).exists()


def test_a_failing_dump_is_said_once_and_never_raised(run_dir, monkeypatch, caplog) -> None:
    def broken(**kw: Any) -> bytes:
        raise RuntimeError("no recorder today")
    fake_torch(monkeypatch, _dump_fr_trace=broken)
    fr = frdump.FlightRecorderDump(run_dir, 2)
    with caplog.at_level(logging.WARNING, logger="peerwatch"):
        assert not fr.dump("diagnosis") and not fr.dump("teardown")
    said = [r.getMessage() for r in caplog.records if "flight recorder" in r.getMessage()]
    assert len(said) == 1 and "rank 2" in said[0] and "no recorder today" in said[0], said


def test_the_report_names_the_folder_and_the_command(run_dir, monkeypatch) -> None:
    assert _report.flight_recorder_entry(run_dir, [0, 1, 2]) is None
    fake_torch(monkeypatch, _dump_fr_trace=recorder(UNNAMED))
    for rank in (0, 2):
        assert frdump.FlightRecorderDump(run_dir, rank).dump("teardown")
    folder = os.path.join(run_dir.path, FLIGHT_RECORDER)
    entry = _report.flight_recorder_entry(run_dir, [0, 1, 2])
    # Rank 1 has none (killed, or not there yet): the analyzer must be told to make do.
    assert entry == {"dir": folder, "ranks": [0, 2], "analyze": f"torchfrtrace {folder} --allow-incomplete-ranks"}
    assert _report.flight_recorder_entry(run_dir, [0, 2])["analyze"] == f"torchfrtrace {folder}"  # type: ignore[index]
    report = _report.build(run_dir)
    jsonschema.validate(report, SCHEMA)
    assert report["flight_recorder"]["ranks"] == [0, 2]
    assert f"flight recorder in {folder}: ranks 0, 2 dumped (torch's analyzer: " in _report.summary(report)


def test_the_summary_printed_while_the_ranks_leave_does_not_pass_the_first_dumps_for_all(run_dir, monkeypatch) -> None:
    """The summary of a hang is printed by the rank that made the verdict once its own dump
    is written, while the others are still dumping as they leave: one dump was listed as
    the flight recorder where four were written. It says what is there so far, and that
    more come; ``peerwatch report`` (after) lists them all."""
    fake_torch(monkeypatch, _dump_fr_trace=recorder(UNNAMED))
    folder = os.path.join(run_dir.path, FLIGHT_RECORDER)
    assert frdump.FlightRecorderDump(run_dir, 0).dump("teardown")
    line = _report.flight_recorder_line(_report.build(run_dir)["flight_recorder"], leaving=True)
    assert line.startswith(f"  flight recorder in {folder}: rank 0 dumped so far; every rank dumps its own as it leaves"), line
    for rank in (1, 2, 3):
        assert frdump.FlightRecorderDump(run_dir, rank).dump("teardown")
    after = _report.summary(_report.build(run_dir))
    assert f"flight recorder in {folder}: ranks 0, 1, 2, 3 dumped (torch's analyzer: torchfrtrace {folder}" in after, after
    assert "so far" not in after
    many = {"dir": folder, "ranks": list(range(17)), "analyze": "torchfrtrace"}
    assert ": 17 ranks dumped (" in _report.flight_recorder_line(many, leaving=False)
