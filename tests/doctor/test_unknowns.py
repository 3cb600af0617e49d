"""Failures no signature fits: a stable fingerprint to group them, and a draft catalog entry
(``hicache signatures new --from diagnosis.json``) for a maintainer to finish."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from cli import app
from doctor.report.fingerprint import normalise
from signatures.models import Signature
from tests.corpus import diagnose_bytes

_TB = "\n".join([
    "[{prefix}]:[2026-0{month}-1{day} 0{hour}:13:18 TP{tp}] Scheduler hit an exception: "
    "Traceback (most recent call last):",
    '[{prefix}]:  File "{root}/sglang/srt/managers/scheduler.py", line {l1}, in '
    "run_scheduler_process",
    "[{prefix}]:    scheduler.event_loop_overlap()",
    '[{prefix}]:  File "{root}/sglang/srt/speculative/eagle_worker.py", line {l2}, in verify',
    "[{prefix}]:    accept_index = self._accept(batch, 0x{addr})",
    "[{prefix}]:RuntimeError: Expected all tensors to be on the same device, but found "
    "cuda:{tp} and cpu ({n} elements)", ""])


def _tb(**kw: object) -> bytes:
    base = {"prefix": "rank0", "month": 1, "day": 1, "hour": 1, "tp": 0,
            "root": "/sgl-workspace/sglang/python", "l1": 2901, "l2": 674, "addr": "7f3a00",
            "n": 128}
    return _TB.format(**{**base, **kw}).encode()


def test_same_failure_same_fingerprint_across_ranks_paths_lines_times() -> None:
    a = diagnose_bytes("a.log", _tb())
    b = diagnose_bytes("b.log", _tb(prefix="rank5", tp=5, month=7, day=9, hour=8, l1=3011,
                                     l2=701, addr="55aa00", n=4096,
                                     root="/usr/local/lib/python3.12/dist-packages"))
    assert a.fingerprint is not None
    assert b.fingerprint is not None
    assert a.fingerprint.id == b.fingerprint.id
    assert a.fingerprint.functions[:1] == ["verify"]


def test_different_failures_different_fingerprints() -> None:
    a = diagnose_bytes("a.log", _tb())
    other = _tb().replace(b"Expected all tensors to be on the same device",
                          b"probability tensor contains either inf, nan or element < 0")
    b = diagnose_bytes("b.log", other)
    assert a.fingerprint is not None
    assert b.fingerprint is not None
    assert a.fingerprint.id != b.fingerprint.id


def test_normalise_keeps_the_words_and_drops_what_varies() -> None:
    assert normalise("shape '[3013, -1, 128]' is invalid for input of size 8192000") == \
        "shape '[N, N, N]' is invalid for input of size N"
    assert normalise("No such file: /data/hicache/9bc7f366d6a739d82b9d8a08c4f5.bin at 0x7f00aa") \
        == "No such file: ID.bin at X"


def test_fingerprint_is_in_the_json_and_the_report(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_bytes(_tb())
    res = CliRunner().invoke(app, ["doctor", str(log), "--json"])
    data = json.loads(res.stdout)
    assert data["fingerprint"]["id"].startswith("fp-")
    res = CliRunner().invoke(app, ["doctor", str(log)])
    assert data["fingerprint"]["id"] in res.stdout


def test_signatures_new_drafts_an_entry_that_loads(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_bytes(_tb())
    diag = tmp_path / "diagnosis.json"
    runner = CliRunner()
    runner.invoke(app, ["doctor", str(log), "--json", "--out", str(diag)])
    out = tmp_path / "draft.yaml"
    res = runner.invoke(app, ["signatures", "new", "--from", str(diag), "--id",
                              "eagle-verify-device-mix", "--out", str(out)])
    assert res.exit_code == 0, res.output
    draft = yaml.safe_load(out.read_text())
    sig = Signature.model_validate(draft)
    assert sig.id == "eagle-verify-device-mix"
    assert sig.recognisers.exceptions[0].type.endswith("RuntimeError")
    assert "verify" in " ".join(sig.recognisers.frames.any)  # type: ignore[union-attr]
    assert "TODO" in sig.root_cause
    # the regex drafted from the normalised message matches the original message again
    import re
    assert re.search(sig.recognisers.exceptions[0].message,
                     "Expected all tensors to be on the same device, but found cuda:3 and cpu "
                     "(77 elements)")


def test_signatures_new_refuses_what_is_not_a_diagnosis(tmp_path: Path) -> None:
    bad = tmp_path / "x.json"
    bad.write_text('{"status": 1}')
    res = CliRunner().invoke(app, ["signatures", "new", "--from", str(bad)])
    assert res.exit_code == 2
    assert "not a diagnosis" in res.output
    res = CliRunner().invoke(app, ["signatures", "new", "--from", str(tmp_path / "none.json")])
    assert res.exit_code == 2


def test_signatures_new_refuses_a_fifo_and_a_device_without_reading_them(tmp_path: Path) -> None:
    import os
    fifo = tmp_path / "diag.json"
    os.mkfifo(fifo)  # no writer: a blocking open would hang the command forever
    for path in (fifo, Path("/dev/zero")):
        res = CliRunner().invoke(app, ["signatures", "new", "--from", str(path)])
        assert res.exit_code == 2
        assert "not a regular file" in res.output


def test_a_crash_with_blocked_peers_drafts_a_crash(tmp_path: Path) -> None:
    """The injected-crash bundle: rank 3 raised, its peers blocked in collectives after it.
    The draft says crash (it used to say hang: any blocked rank made it one)."""
    bundle = Path(__file__).parents[1] / "fixtures/doctor/no-fit/runtime-tp2pp2-injected-crash"
    diag = tmp_path / "d.json"
    runner = CliRunner()
    runner.invoke(app, ["doctor", str(bundle), "--json", "--out", str(diag)])
    res = runner.invoke(app, ["signatures", "new", "--from", str(diag), "--id", "x-crash",
                              "--out", str(tmp_path / "x.yaml")])
    assert res.exit_code == 0, res.output
    assert yaml.safe_load((tmp_path / "x.yaml").read_text())["kind"] == "crash"


def test_similar_to_lines_say_recognisers_in_words() -> None:
    """A near miss's "because" names exceptions by class, never by the catalog's regex."""
    import re

    from doctor.diagnose import diagnose
    from tests.doctor.conftest import case_inputs, fixture_cases

    seen = 0
    for case in fixture_cases():
        for near in diagnose(case_inputs(case)).near_misses:
            seen += "exception" in near.because
            assert not re.search(r"\(\?|\\[wdsb]|\(\\w|\|\w+\)|\.\*", near.because), near.because
    assert seen, "no near miss mentioned an exception: the test saw nothing"


def test_a_function_named_with_an_at_sign_is_drafted_as_itself(tmp_path: Path) -> None:
    """`@` splits a frame pattern into function and file: a drafted `(^|\\.)@$` was loaded as
    a pattern matching every frame. The draft escapes it; the loader refuses a part that
    matches any name."""
    import re

    from signatures.models import FrameRecogniser

    log = tmp_path / "server.log"
    log.write_text("Traceback (most recent call last):\n"
                   '  File "/srv/app/sglang/srt/managers/scheduler.py", line 10, in @\n'
                   "    run()\n"
                   '  File "/srv/app/sglang/srt/managers/scheduler.py", line 20, in a@b\n'
                   "    go()\n"
                   "RuntimeError: boom 12\n")
    diag = tmp_path / "d.json"
    runner = CliRunner()
    runner.invoke(app, ["doctor", str(log), "--json", "--out", str(diag)])
    res = runner.invoke(app, ["signatures", "new", "--from", str(diag), "--id", "at-sign",
                              "--out", str(tmp_path / "x.yaml")])
    assert res.exit_code == 0, res.output
    frames = Signature.model_validate(yaml.safe_load((tmp_path / "x.yaml").read_text())) \
        .recognisers.frames
    assert frames is not None
    for pattern in frames.any:
        func, sep, _ = pattern.partition("@")
        assert not sep, pattern  # no bare '@' left to split on
        assert not re.search(func, "writing_check"), pattern
    assert any(re.search(p, "@") for p in frames.any) or any(re.search(p, "a@b")
                                                              for p in frames.any)
    with pytest.raises(ValueError, match="matches every name"):
        FrameRecogniser(any=[r"(^|\.)@$"], weight=0.3)
