"""The recorded test durations the suite orders its tests by (tests/durations.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests import durations

REPORT = """\
============================= slowest durations ==============================
200.05s call     tests/multirank/test_campaigns.py::test_default_campaign_every_cell_behaves
1.50s setup    tests/faults/test_ray_executor.py::test_cells[a b]
1.20s call     tests/faults/test_ray_executor.py::test_cells[a b]
0.40s teardown tests/faults/test_ray_executor.py::test_cells[a b]
1.90s call     tests/test_cli.py::test_quick
(12 durations < 0.005s hidden.  Use -vv to show these durations.)
=========================== short test summary info ============================
"""


def test_a_report_gives_each_tests_phases_added_up_and_drops_the_short_ones() -> None:
    assert durations.parse(REPORT) == {
        "tests/faults/test_ray_executor.py::test_cells[a b]": 3.1,
        "tests/multirank/test_campaigns.py::test_default_campaign_every_cell_behaves": 200.1,
    }


def test_unrecorded_tests_count_by_their_mark(tmp_path: Path) -> None:
    recorded = {"tests/a.py::test_long": 90.0}
    assert durations.expected_s("tests/a.py::test_long", False, recorded) == 90.0
    assert durations.expected_s("tests/a.py::test_new", True, recorded) == durations.SLOW_S
    assert durations.expected_s("tests/a.py::test_new", False, recorded) == durations.FAST_S


@pytest.mark.parametrize("text", ["", "not json", "[1, 2]", '{"a": "slow"}'])
def test_a_missing_or_bad_file_orders_by_the_marks_alone(tmp_path: Path, text: str) -> None:
    path = tmp_path / "durations.json"
    if text:
        path.write_text(text)
    assert durations.load(path) == {}


def test_the_committed_file_holds_node_ids_of_the_suite() -> None:
    recorded = durations.load()
    assert recorded, "tests/durations.json is missing or unreadable"
    assert json.loads(durations.FILE.read_text()) == recorded
    assert min(recorded.values()) >= durations.MIN_S
    assert all(k.startswith("tests/") and "::" in k for k in recorded)
