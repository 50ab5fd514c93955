"""scripts/sweep.py without Slurm: the points a sweep file expands to, its validation, the
sbatch command lines and the collector's table."""

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import sweep  # noqa: E402


def write(tmp_path, text):
    path = tmp_path / "s.yaml"
    path.write_text(text)
    return str(path)


def test_points_and_commands(tmp_path):
    spec = sweep.load_sweep(write(tmp_path, f"""
base_config: configs/tiny-cpu.yaml
out: {tmp_path}/out
flags: ["--train-iters", "8"]
sbatch_args: ["--nodes", "1"]
ranks: [16, 32, 64, 128]
modes: ["off", "static", "edgc"]
"""))
    names = [n for n, _ in sweep.points(spec)]
    assert names == ["dense"] + [f"static-r{r}" for r in (16, 32, 64, 128)] + \
        [f"edgc-r{r}" for r in (16, 32, 64, 128)]
    flags = dict(sweep.points(spec))
    assert flags["edgc-r64"] == ["--edgc-mode", "edgc", "--edgc-rank-max", "64",
                                 "--edgc-rank-min", "16"]
    cmd = sweep.sbatch_command(spec, "static-r32", flags["static-r32"])
    assert cmd[:4] == ["sbatch", "--parsable", "--job-name", "edgc-static-r32"]
    assert cmd[cmd.index("--nodes") + 1] == "1"
    assert cmd[-2:] == ["--metrics-file", f"{tmp_path}/out/static-r32.jsonl"]
    assert "--edgc-rank" in cmd and cmd[cmd.index("--edgc-rank") + 1] == "32"


@pytest.mark.parametrize("body,fragment", [
    ("out: x\nranks: [16]\nmodes: [static]\n", "missing base_config"),
    ("base_config: c\nout: x\nranks: [0]\nmodes: [static]\n", "ranks must be integers >= 1"),
    ("base_config: c\nout: x\nranks: [16]\nmodes: [fast]\n", "modes must be among"),
    ("base_config: c\nout: x\nranks: [16]\nmodes: [static]\nrank: 3\n", "unknown key"),
])
def test_bad_sweep_files(tmp_path, body, fragment):
    with pytest.raises(sweep.SweepError, match=fragment):
        sweep.load_sweep(write(tmp_path, body))


def test_collect_tabulates_summaries(tmp_path):
    for name, sync, ms, loss, mib in [("static-r32", 12.5, 300.0, 5.5, 2.0),
                                      ("dense", 40.0, 330.0, 5.4, 28.0),
                                      ("edgc-r64", 20.0, 310.0, 5.45, 6.0)]:
        (tmp_path / f"{name}.summary.json").write_text(json.dumps(
            {"grad_sync_ms": sync, "ms_per_iter": ms, "val_loss": loss,
             "dp_bytes_per_iter": mib * 2**20, "iterations": 8}))
    rows = sweep.collect(str(tmp_path))
    assert [r["point"] for r in rows] == ["dense", "static-r32", "edgc-r64"]
    assert rows[1]["rank"] == 32 and rows[2]["mode"] == "edgc"
    text = sweep.table(rows)
    assert "| static-r32 | 8 | 12.5 | 300.0 | 5.5000 | 2.00 |" in text
    assert sweep.main(["collect", str(tmp_path)]) == 0
    assert (tmp_path / "sweep.md").read_text().strip() == text
    assert sweep.main(["collect", str(tmp_path / "empty")]) == 2
