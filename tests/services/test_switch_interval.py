"""The verifier's thread switch interval (services/verifier/cli.py apply_switch_interval): the
loop's helper threads must get the interpreter within a fraction of a step, not Python's 5 ms."""

import subprocess
import sys

import pytest

from services.verifier.cli import DEFAULT_SWITCH_INTERVAL_US, apply_switch_interval
from specd.cli import build_parser


@pytest.fixture
def saved_interval():
    saved = sys.getswitchinterval()
    yield
    sys.setswitchinterval(saved)


def test_apply_sets_microseconds_and_zero_leaves_it(saved_interval):
    apply_switch_interval(250)
    assert sys.getswitchinterval() == pytest.approx(250e-6)
    apply_switch_interval(0)
    assert sys.getswitchinterval() == pytest.approx(250e-6)
    with pytest.raises(ValueError, match="microseconds"):
        apply_switch_interval(-1)


def test_flag_default_and_environment(monkeypatch):
    monkeypatch.delenv("SPECD_SWITCH_INTERVAL_US", raising=False)
    args = build_parser().parse_args(["verifier", "/nowhere"])
    assert args.switch_interval_us == DEFAULT_SWITCH_INTERVAL_US < 5000
    monkeypatch.setenv("SPECD_SWITCH_INTERVAL_US", "1000")
    assert build_parser().parse_args(["verifier", "/nowhere"]).switch_interval_us == 1000


def test_negative_interval_is_refused_with_a_message(tmp_path):
    done = subprocess.run([sys.executable, "-m", "specd.cli", "verifier", str(tmp_path),
                           "--switch-interval-us", "-5"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--switch-interval-us" in done.stderr and "microseconds" in done.stderr
