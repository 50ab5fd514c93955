"""The oldest supported megatron-core (0.13.1) in CI: one small wiring test run on it.

`make test` runs on the pinned megatron-core; this test runs DP compression under
TP1·PP2·DP2 with overlapped reduce and the distributed optimizer on the oldest supported
version, installed with ``pip install --no-deps --target build/compat/py3.11/0.13.1`` (as
``make test-compat`` does; that target runs the whole compat selection on every version)
and put first on PYTHONPATH of a pytest subprocess.
"""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OLDEST = "0.13.1"
TARGET = os.path.join(ROOT, "build", "compat", "py%d.%d" % sys.version_info[:2], OLDEST)
TEST = ("tests/test_dp_compression.py::test_static_rank_trains_with_bytes_from_shapes"
        "[tp1-pp2-dp2-overlap-distopt]")


def prepare(version: str, target: str) -> None:
    """megatron-core ``version`` under ``target`` (what the Makefile's rule does), or skip
    when the package registry cannot be reached."""
    marker = os.path.join(target, ".installed")
    if os.path.exists(marker):
        return
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                           "--disable-pip-version-check", "--target", target,
                           f"megatron-core=={version}"],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        pytest.skip(f"megatron-core {version} could not be installed from the package "
                    f"registry: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    open(marker, "w").close()


def test_oldest_supported_megatron_core_runs_dp_compression():
    prepare(OLDEST, TARGET)
    env = dict(os.environ, PYTHONPATH=TARGET)
    probe = subprocess.run([sys.executable, "-W", "ignore", "-c",
                            "import megatron.core, megatron.core.package_info as p; "
                            "print(p.__version__, megatron.core.__file__)"],
                           env=env, capture_output=True, text=True, timeout=120)
    version, path = probe.stdout.split()
    assert version == OLDEST and path.startswith(TARGET), probe.stdout + probe.stderr
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", TEST],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "1 passed" in proc.stdout
