"""Cross-rank alignment on synthetic runtime dumps: point-to-point pairing (sends with the
receives of the same channel, never aligned like collectives), stage-local groups, and the
order of divergent decisions."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from doctor.diagnose import diagnose


def _fr(group: str, seq: int, op: str, peer: int | None, site: str,
        state: str = "completed", shapes: list[list[int]] | None = None) -> dict[str, Any]:
    return {"group": group, "seq": seq, "op": op, "shapes": shapes or [[4]], "dtype": "int64",
            "peer": peer, "site": site, "state": state, "thread": "MainThread"}


def _write(tmp: Path, rank: int, records: list[dict[str, Any]], pp: int | None = None) -> None:
    d = tmp / f"rank{rank}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "flight_recorder.json").write_text(json.dumps(records))
    if pp is not None:  # a state snapshot names the rank's stage
        (d / "state.json").write_text(json.dumps({"rank": rank, "tp_rank": 0, "pp_rank": pp}))


SEND = "pipeline.py:147:_send_activation"
RECV = "pipeline.py:156:_recv_activation"


def test_sends_pair_with_receives_not_with_each_other(tmp_path: Path) -> None:
    _write(tmp_path, 0, [_fr("pp_act", s, "isend", 1, SEND, "started") for s in (1, 2, 3)])
    _write(tmp_path, 1, [_fr("pp_act", s, "recv", 0, RECV) for s in (1, 2)])
    d = diagnose([str(tmp_path)])
    kinds = [(f.group, f.kind) for f in d.collectives]
    assert ("pp_act", "op-mismatch") not in kinds
    (f,) = d.collectives
    assert f.kind == "unreceived-send"
    assert f.seq == 3
    assert "rank 0's isend #3 to rank 1" in f.detail
    assert "rank 1 received 2 from rank 0" in f.detail
    assert f.evidence[0].file is not None
    assert f.evidence[0].file.endswith("flight_recorder.json")


def test_a_receive_waiting_for_a_send_that_never_came(tmp_path: Path) -> None:
    site = "pipeline.py:173:_result_tokens"
    _write(tmp_path, 0, [_fr("pp_out", 1, "recv", 1, site),
                         _fr("pp_out", 2, "recv", 1, site, "started")])
    _write(tmp_path, 1, [_fr("pp_out", 1, "isend", 0, "pipeline.py:136:_run_stage")])
    d = diagnose([str(tmp_path)])
    (f,) = d.collectives
    assert f.kind == "unmatched-recv"
    assert f.ranks == [0]
    assert "waits for a send that never came" in f.detail
    assert "_result_tokens (pipeline.py:173)" in f.detail


def test_paired_messages_of_different_sizes(tmp_path: Path) -> None:
    _write(tmp_path, 0, [_fr("pp_act", 1, "isend", 1, SEND, shapes=[[96, 64]])])
    _write(tmp_path, 1, [_fr("pp_act", 1, "recv", 0, RECV, shapes=[[2, 64]])])
    (f,) = diagnose([str(tmp_path)]).collectives
    assert f.kind == "size-mismatch"
    assert "[[96, 64]]" in f.detail
    assert "[[2, 64]]" in f.detail


def test_truncated_rings_pair_only_what_they_can(tmp_path: Path) -> None:
    # rank 0's ring lost its first ops but holds one channel only: seq gives the ordinal
    _write(tmp_path, 0, [_fr("pp_act", s, "isend", 1, SEND) for s in (41, 42, 43)])
    _write(tmp_path, 1, [_fr("pp_act", s, "recv", 0, RECV) for s in range(1, 43)])
    (f,) = diagnose([str(tmp_path)]).collectives
    assert (f.kind, f.seq) == ("unreceived-send", 43)
    # a truncated ring that mixes directions says nothing about ordinals: no claim
    mixed = tmp_path / "mixed"
    _write(mixed, 0, [_fr("pp_act", 41, "isend", 1, SEND), _fr("pp_act", 42, "recv", 1, RECV)])
    _write(mixed, 1, [_fr("pp_act", 1, "recv", 0, RECV)])
    assert diagnose([str(mixed)]).collectives == []


def test_stage_local_groups_are_aligned_per_stage(tmp_path: Path) -> None:
    site = "model.py:175:_attention"
    for rank, pp, last in ((0, 0, 3), (1, 0, 3), (2, 1, 5), (3, 1, 5)):
        recs = [_fr("tp_compute", s, "all_reduce", None, site) for s in range(1, last + 1)]
        _write(tmp_path, rank, recs, pp=pp)
    # each stage's tp_compute is its own communicator: 3 vs 5 ops is no missing rank
    assert diagnose([str(tmp_path)]).collectives == []
    _write(tmp_path, 3, [_fr("tp_compute", s, "all_reduce", None, site) for s in range(1, 5)],
           pp=1)
    (f,) = diagnose([str(tmp_path)]).collectives
    assert (f.group, f.kind, f.ranks) == ("tp_compute (PP1)", "missing-ranks", [3])


def _event(rank: int, step: int, kind: str, **attrs: Any) -> str:
    return json.dumps({"rank": rank, "tp": rank, "pp": 0, "step": step, "kind": kind,
                       "thread": "MainThread", "attrs": attrs})


def _trace(tmp: Path, rank: int, lines: list[str]) -> None:
    d = tmp / f"rank{rank}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "events.jsonl").write_text("\n".join(lines) + "\n")


def test_first_divergence_within_a_step_follows_the_trace_order(tmp_path: Path) -> None:
    """At step 18 the ranks first agreed on different drain counts, then built different
    batches; the batch mismatch has the lower occurrence index but came later."""
    for rank, agreed, rids in ((0, 1, ["a", "b"]), (1, 0, ["c"])):
        votes = [_event(rank, s, "sync.vote", site="writing_check", local=0, agreed=0)
                 for s in range(1, 18)]
        _trace(tmp_path, rank, [
            *votes,
            _event(rank, 18, "sync.vote", site="writing_check", local=agreed, agreed=agreed),
            _event(rank, 18, "sched.batch", rids=rids, extend=[1] * len(rids),
                   prefix=[8] * len(rids))])
    d = diagnose([str(tmp_path)])
    assert d.first_divergence is not None
    assert (d.first_divergence.kind, d.first_divergence.key) == ("sync.vote", "writing_check")
    assert d.first_divergence.steps == {0: 18, 1: 18}
    assert any("drain-count-divergence" in line for line in d.rule_log)


def test_drain_rounds_traced_on_one_rank_only_are_not_a_divergence(tmp_path: Path) -> None:
    """The runtime traces a drain_counts round only when the rank's own counts are non-zero:
    an all-zero agreement appears on some ranks and not on others."""
    zero, one = [0] * 7, [1] + [0] * 6
    _trace(tmp_path, 0, [_event(0, 5, "sync.vote", site="drain_counts", local=one, agreed=one)])
    _trace(tmp_path, 1, [
        _event(1, 4, "sync.vote", site="drain_counts", local=one, agreed=zero),
        _event(1, 5, "sync.vote", site="drain_counts", local=one, agreed=one)])
    assert diagnose([str(tmp_path)]).first_divergence is None


def test_evictions_compare_victims(tmp_path: Path) -> None:
    for rank, victims in ((0, [15, 17]), (1, [17, 19])):
        _trace(tmp_path, rank, [_event(rank, 62, "tree.evict", want=16, evicted=48,
                                       victims=victims)])
    d = diagnose([str(tmp_path)])
    assert d.first_divergence is not None
    assert d.first_divergence.kind == "tree.evict"
    assert "victims" in d.first_divergence.values[0]


def _evict_after_abort(tmp: Path, abort_step: int) -> list[str]:
    """Two TP ranks that evict differently at step 62; rank 0 alone applied an abort at
    ``abort_step`` (an abort torn down on the spot on one rank); both traces cover it."""
    for rank, victims in ((0, [15, 17]), (1, [17, 19])):
        lines = [_event(rank, 1, "req.arrive", rid="r1")]
        if rank == 0:
            lines.append(_event(0, abort_step, "req.abort.applied", rid="r1",
                                on_the_spot=True))
        lines.append(_event(rank, 62, "tree.evict", want=16, evicted=48, victims=victims))
        lines.append(_event(rank, 70, "req.arrive", rid="r2"))
        _trace(tmp, rank, lines)
    return diagnose([str(tmp)]).fingerprint.facts


def test_an_eviction_after_a_one_sided_abort_is_a_consequence(tmp_path: Path) -> None:
    """The ranks' histories differed from the abort on: their later evictions differ because
    one rank got the request's pages back, not because their clocks ordered LRU differently."""
    assert "eviction-divergence" not in _evict_after_abort(tmp_path / "before", 40)
    # An abort only after the evictions differed takes nothing from them.
    assert "eviction-divergence" in _evict_after_abort(tmp_path / "after", 65)


def _watchdogs(enqueued: dict[int, int], pg: dict[int, int] | None = None) -> str:
    """torch's watchdog lines of ranks whose WorkNCCL line was cut before its SeqNum."""
    out = []
    for r, n in enqueued.items():
        g = (pg or {}).get(r, 0)
        out.append(f"[rank{r}]:[E1218 20:27:21.426415540 ProcessGroupNCCL.cpp:632] [Rank {r}] "
                   "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=")
        out.append(f"[rank{r}]:[E1218 20:27:21.426415540 ProcessGroupNCCL.cpp:1616] [PG ID {g} "
                   f"PG GUID {g}(default_pg) Rank {r}] Timeout at NCCL work: {n}, last enqueued "
                   f"NCCL work: {n}, last completed NCCL work: {n - 1}.")
    return "\n".join(out) + "\n"


def test_a_rank_that_enqueued_fewer_collectives_is_behind(tmp_path: Path) -> None:
    (tmp_path / "job.log").write_text(_watchdogs({0: 21937, 1: 21936, 2: 21937, 3: 21937}))
    d = diagnose([str(tmp_path)])
    behind = [c for c in d.collectives if c.kind == "seq-behind"]
    assert [(c.group, c.ranks, c.seq) for c in behind] == [("PG 0", [1], 21936)]
    # one kind of evidence (sequence counts, no stacks, no watchdog SeqNum): a near miss
    assert [n.signature for n in d.near_misses][:1] == ["collective-order-deadlock"]


def test_equal_enqueued_counts_or_other_groups_say_nothing(tmp_path: Path) -> None:
    (tmp_path / "same.log").write_text(_watchdogs({0: 811, 1: 811}))
    assert not [c for c in diagnose([str(tmp_path / "same.log")]).collectives
                if c.kind == "seq-behind"]
    # two process groups count their collectives apart: 5 in one is not behind 9 in another
    (tmp_path / "groups.log").write_text(_watchdogs({0: 9, 1: 5}, pg={0: 0, 1: 3}))
    assert not [c for c in diagnose([str(tmp_path / "groups.log")]).collectives
                if c.kind == "seq-behind"]


def _wrapped_watchdog(rank: int, seq: int, numel: int) -> str:
    """A watchdog record as a report pasted it: torchrun's prefix without its colon, the
    record broken over three lines."""
    return (f"[rank{rank}] Watchdog caught collective operation timeout:\n"
            f"WorkNCCL(SeqNum={seq}, OpType=ALLREDUCE,\n"
            f"NumelIn={numel}, NumelOut={numel}, Timeout(ms)=600000)\n\n")


def test_a_watchdog_record_wrapped_over_lines_is_read_whole(tmp_path: Path) -> None:
    (tmp_path / "job.log").write_text(_wrapped_watchdog(6, 1320347, 4501504)
                                      + _wrapped_watchdog(5, 1320347, 8171520))
    d = diagnose([str(tmp_path)])
    assert {r.rank: r.last_seq.get("nccl") for r in d.ranks} == {
        5: "timed out at SeqNum 1320347 (ALLREDUCE)",
        6: "timed out at SeqNum 1320347 (ALLREDUCE)"}
    # one collective, two sizes: the NumelIn of the record's last line was read
    assert "collective-size-mismatch" in d.fingerprint.facts


def test_watchdog_records_far_apart_are_separate_hangs(tmp_path: Path) -> None:
    """Two occurrences quoted one after another (the job restarted and hung again) are not
    one hang where half the ranks are 564236 collectives behind: each is read alone."""
    (tmp_path / "job.log").write_text(
        _wrapped_watchdog(6, 1320347, 4501504) + _wrapped_watchdog(5, 1320347, 8171520)
        + _wrapped_watchdog(3, 1884583, 43710464) + _wrapped_watchdog(4, 1884583, 43710464))
    d = diagnose([str(tmp_path)])
    assert not [c for c in d.collectives if c.kind == "seq-behind"]
    assert "collective-size-mismatch" in d.fingerprint.facts
    # within one hang a rank a few collectives behind still is
    (tmp_path / "job.log").write_text(_wrapped_watchdog(0, 1320349, 8) + _wrapped_watchdog(
        1, 1320347, 8))
    behind = [c for c in diagnose([str(tmp_path)]).collectives if c.kind == "seq-behind"]
    assert [(c.ranks, c.seq) for c in behind] == [([1], 1320347)]


_HUNG = ("[rank1]:[E1218 20:27:21.426415540 ProcessGroupNCCL.cpp:632] [Rank 1] Watchdog caught "
         "collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE, NumelIn=32768000, "
         "NumelOut=32768000, Timeout(ms)=600000) ran for 600081 milliseconds before timing out.\n")


def test_ranks_that_print_different_sizes_for_one_collective(tmp_path: Path) -> None:
    """A reporter's debug print of what each rank feeds a collective: ranks of one print
    that state different sizes fed it different sizes (NCCL#1417's rank 0)."""
    def prints(sizes: dict[int, int], verb: str = "before allreduce") -> str:
        return "".join(f"# Rank {r} tensor {verb}: torch.Size([{n}]) 1.0\n"
                       for r, n in sizes.items()) + _HUNG


    (tmp_path / "a.log").write_text(prints({7: 32768000, 0: 409600, 1: 32768000}))
    d = diagnose([str(tmp_path / "a.log")])
    assert "collective-size-mismatch" in d.fingerprint.facts
    assert d.verdicts[0].signature == "collective-shape-mismatch"
    # the same sizes everywhere, or two prints of different wording (an all-gather's input
    # and its output), say nothing
    (tmp_path / "b.log").write_text(prints({0: 8, 1: 8}))
    (tmp_path / "c.log").write_text(prints({0: 8}, "before all_gather")
                                    + prints({1: 16}, "after all_gather"))
    for name in ("b.log", "c.log"):
        assert "collective-size-mismatch" not in diagnose(
            [str(tmp_path / name)]).fingerprint.facts, name


def _fingerprint(rank: int, seq: int, op: str, shape: str, dtype: str) -> str:
    return (f"Rank {rank} is running collective: CollectiveFingerPrint(SequenceNumber={seq}, "
            f"OpType={op}, TensorShape=[{shape}], TensorDtypes={dtype}, TensorDeviceTypes="
            "TensorOptions(dtype=float (default), device=cuda, layout=Strided (default)))")


def test_torch_s_list_of_differing_aspects_decides_order_or_size(tmp_path: Path) -> None:
    """torch's check (ProcessGroupWrapper.cpp compute_collective_diff) lists what differs: the
    same op, sequence number and shape in other dtypes is a size fault (each rank sends
    another number of bytes); another sequence number is an ordering fault."""
    def report(a: str, b: str, aspects: str) -> str:
        return (f"[rank7]: RuntimeError: Detected mismatch between collectives on ranks. {a}, "
                f"but {b}.Collectives differ in the following aspects: {aspects}\n")

    (tmp_path / "dtype.log").write_text(report(
        _fingerprint(7, 5, "_ALLGATHER_BASE", "1", "Float"),
        _fingerprint(0, 5, "_ALLGATHER_BASE", "1", "BFloat16"),
        "  Tensor Tensor dtypes: Floatvs BFloat16"))
    d = diagnose([str(tmp_path / "dtype.log")])
    assert "collective-size-mismatch" in d.fingerprint.facts
    assert "collective-op-mismatch" not in d.fingerprint.facts
    assert d.verdicts
    assert d.verdicts[0].signature == "collective-shape-mismatch"
    (tmp_path / "seq.log").write_text(report(
        _fingerprint(7, 5, "ALLREDUCE", "4", "Float"),
        _fingerprint(0, 5, "ALLREDUCE", "4", "Float"), "\t Sequence number: 5vs 6"))
    d = diagnose([str(tmp_path / "seq.log")])
    assert "collective-op-mismatch" in d.fingerprint.facts
    assert "collective-size-mismatch" not in d.fingerprint.facts


def test_a_collective_s_own_check_of_its_members_shapes_in_other_words(tmp_path: Path) -> None:
    """A framework's own cross-member check (TensorFlow's "expected shape [A] but another
    member in the group expected shape [B]") is a size fault; a line about a collective and
    its other members that states no sizes (a member that went away) is not."""
    (tmp_path / "tf.log").write_text(
        "Collective ops is aborted by: Shape mismatch in the collective instance 100. Op at "
        "device /job:localhost/replica:0/task:0/device:GPU:2 expected shape [28678440] but "
        "another member in the group expected shape [39166184]. This is likely due to "
        "different input shapes at different members of the collective op.\n")
    d = diagnose([str(tmp_path / "tf.log")])
    assert "collective-size-mismatch" in d.fingerprint.facts
    assert d.verdicts
    assert d.verdicts[0].signature == "collective-shape-mismatch"
    (tmp_path / "gone.log").write_text(
        "Collective ops is aborted by: another member of the collective group failed: "
        "connection reset by peer\n")
    assert "collective-size-mismatch" not in diagnose(
        [str(tmp_path / "gone.log")]).fingerprint.facts
