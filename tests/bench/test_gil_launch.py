"""bench/gil_launch.py: the loop's orders around the result writer, against the embedded Redis and
a drafter in another process; each order reports the launch call's wait and the launch path."""

from __future__ import annotations

import pytest

from bench.gil_launch import ORDERS, main


def test_every_order_runs_and_the_unstaged_fill_is_on_the_launch_path():
    rows = main(["--steps", "30", "--rounds", "1", "--forward-ms", "0.5", "--stage-us", "300"])
    assert [r["order"] for r in rows] == list(ORDERS)
    for r in rows:
        assert 0 < r["wait_median_us"] <= r["wait_p90_us"]
        assert r["path_median_us"] >= r["wait_median_us"]
    none = next(r for r in rows if r["order"] == "none")
    assert none["path_median_us"] >= 300  # no stage: the fill waits for the drafts


def test_an_unknown_order_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(["--orders", "step,early"])
    assert "unknown ['early']" in capsys.readouterr().err
