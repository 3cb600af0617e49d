"""A DP group's side of the controller (the entry rank's feed), the grid's rank numbering, the
DP config, and the one bundle renumbered from every group's rank folders. In process, fast."""

from __future__ import annotations

import json
import multiprocessing
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

from hicache_runtime.config import load_config
from hicache_runtime.contracts.bundle import (
    RankEntry,
    RankFiles,
    RunOutcome,
    load_manifest,
    rank_dir,
    write_text,
)
from hicache_runtime.contracts.errors import ConfigError
from hicache_runtime.contracts.events import Ev
from hicache_runtime.contracts.run_files import (
    RANK_ENTRY,
    RANK_EVENTS,
    RANK_FLIGHT_RECORDER,
    RANK_STATE,
    RunDir,
)
from hicache_runtime.contracts.topology import RankInfo
from hicache_runtime.kv.request import Req, ReqStatus
from hicache_runtime.launch.bundles import RankExit
from hicache_runtime.launch.dp_bundle import group_dir, write_dp_bundle
from hicache_runtime.launch.dp_intake import (
    Abort,
    ControllerFeed,
    EndOfStream,
    Finished,
    Routed,
    controller_feed,
)
from hicache_runtime.launch.dp_routing import LoadBoard
from hicache_runtime.launch.launcher import launch
from hicache_runtime.telemetry.perfetto import (
    CONTROLLER_RANK,
    MAX_RANK,
    export_perfetto,
    parse_event,
)
from hicache_runtime.telemetry.tracer import Tracer


@pytest.fixture
def feed() -> Iterator[tuple[ControllerFeed, Connection, LoadBoard, Tracer]]:
    """Group 1 of two: the feed on one end of a real pipe, the controller's end and the board
    (one object: attaching in the creating process would count twice with its tracker)."""
    ours, theirs = multiprocessing.Pipe()
    board = LoadBoard(2, create=True)
    tracer = Tracer(RankInfo.of(0, 1, 1, dp_rank=1, dp_size=2))
    f = ControllerFeed(theirs, board, 1, 5, tracer, lambda: False)
    yield f, ours, board, tracer
    f.close()  # closes and unlinks the board too
    ours.close()


def _req(rid: str, n: int = 4) -> Req:
    return Req(rid=rid, input_ids=list(range(1, n + 1)), max_new_tokens=3, arrival_step=7)


def test_the_feed_hands_over_requests_and_reports_what_finished(feed) -> None:
    f, ctl, board, tracer = feed
    ctl.send(Routed.of(_req("a"), "shortest-queue", (0, 1)))
    ctl.send(Routed.of(_req("b"), "routed", ()))
    got = f.poll(1, {})
    assert [(r.rid, r.input_ids, r.max_new_tokens, r.arrival_step) for r in got] == [
        ("a", [1, 2, 3, 4], 3, 7), ("b", [1, 2, 3, 4], 3, 7)]
    assert board.snapshot()[1][:2] == (2, 1)  # load 2 (both held), at step 1
    assert f.poll(2, {}) == []
    assert not f.exhausted()
    a = got[0]
    a.output_ids, a.status = [9, 8, 7], ReqStatus.FINISHED
    f.poll(3, {"a": a})
    assert ctl.poll(1)
    report = ctl.recv()
    assert report == [Finished("a", [1, 2, 3, 4], [9, 8, 7], "finished", None)]
    assert report[0].as_req(42).finish_step == 42
    assert board.snapshot()[1][:2] == (1, 3)
    f.poll(4, {"a": a})  # nothing new: no report
    assert not ctl.poll(0.01)
    received = [e["attrs"] for e in tracer.events() if e["kind"] == Ev.DP_RECEIVE]
    assert received[0] == {"what": "request", "rid": "a", "group": 1,
                           "reason": "shortest-queue", "loads": [0, 1]}


def test_aborts_apply_only_to_requests_the_group_holds_and_the_end_stops_it(feed) -> None:
    f, ctl, _, tracer = feed
    ctl.send(Routed.of(_req("mine"), "round-robin", ()))
    ctl.send(Abort("mine"))
    ctl.send(Abort("elsewhere"))
    assert [r.rid for r in f.poll(1, {})] == ["mine"]
    assert f.aborts(1) == ["mine"]
    assert f.aborts(2) == []
    ctl.send(EndOfStream())
    f.poll(2, {})
    assert f.exhausted()
    held = {e["attrs"].get("rid"): e["attrs"].get("held") for e in tracer.events()
            if e["kind"] == Ev.DP_RECEIVE and e["attrs"]["what"] == "abort"}
    assert held == {"mine": True, "elsewhere": False}


def test_a_closed_controller_fails_the_entry_rank(feed) -> None:
    f, ctl, _, _ = feed
    ctl.close()
    with pytest.raises(RuntimeError, match="closed the request feed"):
        f.poll(1, {})


def test_only_the_entry_rank_of_a_dp_run_has_a_feed(monkeypatch: pytest.MonkeyPatch) -> None:
    tracer = Tracer(RankInfo())
    monkeypatch.delenv("HICACHE_DP_FEED_FD", raising=False)
    assert controller_feed(1, 0, tracer, 3, lambda: False) is None
    assert controller_feed(2, 1, tracer, 3, lambda: False) is None
    with pytest.raises(ConfigError, match="DP controller"):
        controller_feed(2, 0, tracer, 3, lambda: False)


def test_grid_ranks_and_labels() -> None:
    r = RankInfo.of(3, 2, 2, dp_rank=1, dp_size=2)
    assert (r.rank, r.tp_rank, r.pp_rank, r.grid_rank) == (3, 1, 1, 7)
    assert r.stage_ranks(1) == [2, 3]  # its own world's ranks
    assert r.label == "DP1 TP1 PP1"
    assert RankInfo.of(3, 2, 2).label == "TP1 PP1"


def test_dp_config_and_its_reference() -> None:
    cfg = load_config({"topology.dp": 3, "topology.tp": 2, "topology.dp_policy": "shortest-queue"})
    assert (cfg.topology.world_size, cfg.topology.grid_size) == (2, 6)
    ref = cfg.reference()
    assert (ref.topology.dp, ref.topology.tp, ref.topology.dp_policy) == (1, 2, "round-robin")
    with pytest.raises(ConfigError, match=r"topology\.dp_policy"):
        load_config({"topology.dp_policy": "random"})
    with pytest.raises(ConfigError, match=r"topology\.dp"):
        load_config({"topology.dp": 0})


def _group_rank(run_dir: Path, group: int, rank: int, tp: int) -> None:
    """What a rank of a DP group leaves in its group's run directory."""
    run = RunDir(group_dir(run_dir, group))
    d = rank_dir(run.bundle, rank)
    info = RankInfo.of(rank, tp, 1)
    ev = {"seq": 1, "t_ns": 1, "rank": rank, "tp": info.tp_rank, "pp": 0, "thread": "main",
          "step": 3, "kind": Ev.BATCH, "attrs": {"rids": [f"g{group}"]}}
    events = write_text(d / RANK_EVENTS, json.dumps(ev) + "\n")
    state = write_text(d / RANK_STATE, json.dumps({"rank": rank, "tp_rank": info.tp_rank,
                                                    "pp_rank": 0, "step": 3}))
    fr = write_text(d / RANK_FLIGHT_RECORDER, json.dumps([
        {"group": "pp_act", "seq": 1, "op": "send", "peer": 1 - rank, "site": "x",
         "state": "completed", "thread": "main", "t_start_ns": 1}]))
    entry = RankEntry(rank=rank, tp_rank=info.tp_rank, pp_rank=0, outcome=RunOutcome.CRASH,
                      files=RankFiles(events=events, state=state, flight_recorder=fr))
    write_text(d / RANK_ENTRY, entry.model_dump_json())
    run.log(rank).write_text(f"log of group {group} rank {rank}\n")


def test_one_bundle_numbers_every_group_s_ranks_in_the_grid(tmp_path: Path) -> None:
    cfg = load_config({"topology.dp": 2, "topology.tp": 2})
    run_dir = tmp_path / "run"
    for g in range(2):
        for r in range(2):
            _group_rank(run_dir, g, r, 2)
    exits = {g: RankExit(g, 1, 1000 + g) for g in range(4)}
    controller = [{"kind": Ev.DP_ROUTE, "rank": -1, "attrs": {"rid": "g1", "group": 1}}]
    bundle = write_dp_bundle(run_dir, cfg, tmp_path / "bundles", RunOutcome.CRASH, "boom",
                             exits, {}, [], controller)
    m = load_manifest(bundle)
    assert m.topology == {"tp": 2, "pp": 1, "dp": 2, "world_size": 4}
    assert [(e.rank, e.dp_rank, e.tp_rank, e.exit_code) for e in m.ranks] == [
        (0, 0, 0, 1), (1, 0, 1, 1), (2, 1, 0, 1), (3, 1, 1, 1)]
    e3 = m.ranks[3]
    assert (e3.files.events, e3.files.log) == ("rank3/events.jsonl", "rank3/log.txt")
    assert (bundle / "rank3" / "log.txt").read_text() == "log of group 1 rank 1\n"
    ev = json.loads((bundle / "rank3" / RANK_EVENTS).read_text())
    assert (ev["rank"], ev["dp"], ev["attrs"]) == (3, 1, {"rids": ["g1"]})
    state = json.loads((bundle / "rank2" / RANK_STATE).read_text())
    assert (state["rank"], state["dp_rank"]) == (2, 1)
    fr = json.loads((bundle / "rank2" / RANK_FLIGHT_RECORDER).read_text())
    assert fr[0]["peer"] == 3  # group 1's rank 1
    assert json.loads((bundle / "rank0" / RANK_FLIGHT_RECORDER).read_text())[0]["peer"] == 1
    assert not list(bundle.glob(f"rank*/{RANK_ENTRY}"))
    assert json.loads((bundle / "controller" / RANK_EVENTS).read_text()) == controller[0]


def test_the_controller_s_trace_exports_as_a_process_of_its_own(tmp_path: Path) -> None:
    tracer = Tracer(RankInfo(CONTROLLER_RANK, 0, 0, 1, 1, 0, 2), jsonl_path=tmp_path / "c.jsonl")
    tracer.emit(Ev.DP_ROUTE, rid="a", group=1, reason="round-robin", loads=[], board=[0, 0],
                to=[1])
    tracer.close()
    assert parse_event(b'{"kind": "x", "t_ns": 1, "rank": -2, "attrs": {}}') is None
    stats = export_perfetto([tmp_path / "c.jsonl"], tmp_path / "c.json")
    assert stats.events == 1
    records = json.loads((tmp_path / "c.json").read_text())["traceEvents"]
    names = {r["pid"]: r["args"]["name"] for r in records if r["name"] == "process_name"}
    assert names == {MAX_RANK: "DP controller"}
    (route,) = [r for r in records if r["name"] == Ev.DP_ROUTE]
    assert (route["pid"], route["args"]["group"]) == (MAX_RANK, 1)


def test_the_launcher_of_one_group_leaves_several_to_the_controller(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="DP controller"):
        launch(load_config({"topology.dp": 2}), bundle_root=tmp_path)
    assert not list(tmp_path.iterdir())
