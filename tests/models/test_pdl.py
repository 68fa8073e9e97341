"""The PDL switch (specd/models/kernels/pdl.py): its modes, its scope, and where it stays off.

What PDL changes on the GPU (the griddepcontrol instructions, before any store) is checked in
test_kernels_compile.py on the compiled PTX; the kernels' values with it off run everywhere else.
"""

from __future__ import annotations

import pytest
import torch

from specd import settings
from specd.models.kernels import pdl


def test_modes_are_validated_and_read_from_the_environment(monkeypatch):
    monkeypatch.delenv(settings.PDL.name, raising=False)
    assert pdl.resolve_pdl_mode(None) == "auto"
    monkeypatch.setenv(settings.PDL.name, "0")
    assert pdl.resolve_pdl_mode(None) == "off"
    assert pdl.resolve_pdl_mode("auto") == "auto"  # an explicit mode wins over the environment
    with pytest.raises(ValueError, match="pdl"):
        pdl.resolve_pdl_mode("sometimes")


def test_scope_restores_the_outer_mode():
    assert pdl.active_mode() == "off"  # outside any runner: plain launches
    with pdl.pdl_launches("auto"):
        assert pdl.active_mode() == "auto"
        with pdl.pdl_launches("off"):
            assert pdl.active_mode() == "off"
        assert pdl.active_mode() == "auto"
    assert pdl.active_mode() == "off"


def test_never_on_cpu_and_launch_options_follow():
    with pdl.pdl_launches("auto"):
        assert not pdl.use_pdl(torch.zeros(2))
    assert pdl.launch_options(False) == {"USE_PDL": False}  # no launch_pdl: the interpreter's path
    assert pdl.launch_options(True) == {"USE_PDL": True, "launch_pdl": True}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_probe_on_the_device_matches_its_capability():
    with pdl.pdl_launches("auto"):
        on = pdl.use_pdl(torch.zeros(2, device="cuda"))
    assert on == (torch.cuda.get_device_capability()[0] >= 9)  # the probe ran eager and captured


def test_runner_scopes_on_two_threads_neither_see_nor_leak_each_other():
    """The GEMM backend and PDL mode apply to the thread that set them: two runners
    forwarding on two threads, their scopes entered and left interleaved (A in, B in, A out, B
    out: as module globals B's exit restored A's value), leave both threads at the defaults."""
    import threading

    from specd.models import linear

    def settings():
        return linear.active_backend(), pdl.active_mode()

    defaults = settings()
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def runner_a():
        with linear.gemm_backend("auto"), pdl.pdl_launches("auto"):
            a_in.set()
            b_in.wait(5)
            seen["a inside"] = settings()
        a_out.set()
        seen["a after"] = settings()

    thread = threading.Thread(target=runner_a)
    thread.start()
    a_in.wait(5)
    seen["b before"] = settings()  # A's scope is not this thread's
    with linear.gemm_backend("torch"), pdl.pdl_launches("off"):
        b_in.set()
        a_out.wait(5)
    thread.join(5)
    assert seen["b before"] == defaults and seen["a inside"] == ("auto", "auto")
    assert seen["a after"] == defaults and settings() == defaults
