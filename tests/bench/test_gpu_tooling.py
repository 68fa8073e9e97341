"""The GPU run's tooling on CPU: the wheel-set checker (scripts/check_wheels.py) and the e2e
bench's teardown when a service dies (the first H200 run hung on an orphaned stack)."""

from __future__ import annotations

import importlib.util
import os
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _checker():
    spec = importlib.util.spec_from_file_location("check_wheels", ROOT / "scripts" / "check_wheels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _wheel(folder: Path, name: str, version: str, requires: list[str], tag: str = "py3-none-any") -> Path:
    path = folder / f"{name}-{version}-{tag}.whl"
    meta = "Metadata-Version: 2.1\nName: {}\nVersion: {}\n".format(name, version)
    meta += "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}-{version}.dist-info/METADATA", meta)
    return path


def test_checker_accepts_a_closed_set_and_names_each_gap(tmp_path):
    check = _checker().check
    _wheel(tmp_path, "fastapi", "0.165.0", ["starlette>=1.6", "opentelemetry-api>=1.44",
                                            "typing-extensions>=4.8", "uvloop; sys_platform == 'win32'",
                                            "httpx; extra == 'all'"])
    _wheel(tmp_path, "starlette", "1.10.0", ["anyio<5,>=4"])  # anyio: in the image's list
    errors, _ = check(tmp_path)
    assert errors == ["fastapi-0.165.0-py3-none-any.whl needs opentelemetry-api>=1.44: "
                      "neither in .whl nor in the image"]
    _wheel(tmp_path, "opentelemetry_api", "1.40.0", [])  # too old for fastapi's specifier
    errors, _ = check(tmp_path)
    assert len(errors) == 1 and "opentelemetry-api>=1.44" in errors[0] and "1.40.0" in errors[0]
    (tmp_path / "opentelemetry_api-1.40.0-py3-none-any.whl").unlink()
    _wheel(tmp_path, "opentelemetry_api", "1.45.2", [])
    errors, assumed = check(tmp_path)
    assert errors == []
    assert any("anyio" in a for a in assumed)  # the image's anyio version is not known here


def test_checker_refuses_two_versions_wrong_platforms_and_known_image_versions(tmp_path):
    check = _checker().check
    _wheel(tmp_path, "grpcio", "1.85.3", [], tag="cp312-cp312-manylinux_2_17_x86_64")
    _wheel(tmp_path, "grpcio", "1.80.0", [], tag="cp312-cp312-manylinux_2_17_x86_64")
    _wheel(tmp_path, "jiter", "0.19.0", [], tag="cp311-cp311-manylinux_2_17_x86_64")
    _wheel(tmp_path, "xgrammar", "0.2.9", ["torch>=2.12"], tag="cp312-cp312-manylinux_2_28_aarch64")
    errors, _ = check(tmp_path)
    text = "\n".join(errors)
    assert "grpcio: 2 versions" in text
    assert "jiter-0.19.0-cp311-cp311-manylinux_2_17_x86_64.whl: no tag installs" in text
    assert "xgrammar-0.2.9-cp312-cp312-manylinux_2_28_aarch64.whl: no tag installs" in text
    assert "needs torch>=2.12: the image has 2.11.0" in text


def test_e2e_stack_that_fails_to_start_leaves_no_process(tiny_models, tmp_path):
    """A drafter that dies at start (its draft model does not exist): run_method raises within
    seconds and every process it started is gone (no orphan holding the log pipe)."""
    from bench.e2e import make_prompts, run_method

    tag = f"test-teardown-{os.getpid()}-{time.monotonic_ns()}"
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="drafter exited"):
        run_method("eagle3", Path(tiny_models["target-llama"]), tmp_path / "no-such-draft", [1],
                   make_prompts(1, 200), 4, 3, "cpu", extra_env={"SPECD_BENCH_TAG": tag})
    assert time.monotonic() - t0 < 240
    left = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if f"SPECD_BENCH_TAG={tag}".encode() in (d / "environ").read_bytes().split(b"\0"):
                    left.append(d.name)
            except OSError:
                pass
    assert left == []


def test_step_row_marks_unmeasured_columns():
    import bench.step as step

    row = step.StepRow(1, 4, 1.5, 2.0, None, 0.5)
    assert "| 1 | 4 | 1.50 | - |" in step.format_row(row)


def test_a_column_out_of_memory_costs_that_column_only():
    """On an 80 GB H100 transformers' cache at batch 128 runs the device out of memory; that column
    reads OOM and the bench's other rows are still written."""
    import torch

    import bench.step as step

    def too_big():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 256.00 MiB")

    oom: list[str] = []
    assert step.unless_out_of_memory("transformers", oom, too_big) is None and oom == ["transformers"]
    assert step.unless_out_of_memory("eager", oom, lambda: 3.5) == 3.5 and oom == ["transformers"]
    row = step.StepRow(128, 4, 19.9, 58.5, None, 3.35, out_of_memory=tuple(oom))
    assert "| 58.50 | OOM | 3.35 |" in step.format_row(row)
    assert "| 58.50 | - | 3.35 |" in step.format_row(step.StepRow(128, 4, 19.9, 58.5, None, 3.35))
    with pytest.raises(RuntimeError):  # any other failure still fails the bench
        step.unless_out_of_memory("transformers", oom, lambda: (_ for _ in ()).throw(RuntimeError("bug")))
