#!/usr/bin/env python
"""Config-driven rank sweeps on Slurm: submit one job per (mode, rank) point, then
tabulate what the jobs measured.

    python scripts/sweep.py submit configs/sweeps/rank-sweep-tiny.yaml [--dry-run]
    python scripts/sweep.py collect runs/sweep-tiny            # → table on stdout + sweep.md

Sweep YAML: ``base_config`` (trainer config), ``sbatch_script``, ``sbatch_args``, ``env``
(exported to the jobs), ``out`` (metrics directory), ``flags`` (trainer flags for every
point), ``ranks`` and ``modes``. Points: ``off`` once (dense), ``static`` at every rank
(``--edgc-rank R``), ``edgc`` at every rank as r_max (``--edgc-rank-max R``, r_min = R/4).
Each job writes ``<out>/<point>.jsonl`` and its summary; ``collect`` reads them.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEYS = {"base_config", "sbatch_script", "sbatch_args", "env", "out", "flags", "ranks", "modes"}
MODES = ("off", "static", "edgc")


class SweepError(ValueError):
    pass


def load_sweep(path: str) -> dict:
    if not os.path.isfile(path):
        raise SweepError(f"{path}: does not exist")
    with open(path) as fh:
        spec = yaml.safe_load(fh) or {}
    unknown = set(spec) - KEYS
    if unknown:
        raise SweepError(f"{path}: unknown key(s) {sorted(unknown)}; allowed {sorted(KEYS)}")
    for key in ("base_config", "out", "ranks", "modes"):
        if key not in spec:
            raise SweepError(f"{path}: missing {key}")
    bad = [r for r in spec["ranks"] if not isinstance(r, int) or r < 1]
    if bad:
        raise SweepError(f"{path}: ranks must be integers >= 1, got {bad}")
    bad = [m for m in spec["modes"] if m not in MODES]
    if bad:
        raise SweepError(f"{path}: modes must be among {MODES}, got {bad}")
    spec.setdefault("sbatch_script", "scripts/slurm/edgc.sbatch")
    spec.setdefault("sbatch_args", [])
    spec.setdefault("env", {})
    spec.setdefault("flags", [])
    return spec


def points(spec: dict) -> list[tuple[str, list]]:
    """(name, trainer flags) of every point, in submission order."""
    out = []
    for mode in spec["modes"]:
        if mode == "off":
            out.append(("dense", ["--edgc-mode", "off"]))
            continue
        for r in spec["ranks"]:
            if mode == "static":
                out.append((f"static-r{r}", ["--edgc-mode", "static", "--edgc-rank", str(r)]))
            else:
                out.append((f"edgc-r{r}", ["--edgc-mode", "edgc", "--edgc-rank-max", str(r),
                                           "--edgc-rank-min", str(max(1, r // 4))]))
    return out


def sbatch_command(spec: dict, name: str, flags: list) -> list:
    out = os.path.abspath(spec["out"])
    return ["sbatch", "--parsable", "--job-name", f"edgc-{name}",
            "--output", os.path.join(out, f"{name}.out"), *map(str, spec["sbatch_args"]),
            os.path.join(ROOT, spec["sbatch_script"]),
            "--config", os.path.join(ROOT, spec["base_config"]), *map(str, spec["flags"]),
            *flags, "--metrics-file", os.path.join(out, f"{name}.jsonl")]


def submit(path: str, dry_run: bool) -> list:
    spec = load_sweep(path)
    os.makedirs(spec["out"], exist_ok=True)
    env = {**os.environ, **{k: str(v) for k, v in spec["env"].items()}, "EDGC_ROOT": ROOT,
           "EDGC_PYTHON": sys.executable}
    jobs = []
    for name, flags in points(spec):
        cmd = sbatch_command(spec, name, flags)
        if dry_run:
            print(" ".join(cmd))
            continue
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
        if proc.returncode != 0:
            raise SweepError(f"sbatch failed for {name}: {proc.stderr.strip()}")
        job = proc.stdout.strip().split(";")[0]
        print(f"{name}: job {job}", flush=True)
        jobs.append((name, job))
    return jobs


def collect(out: str) -> list[dict]:
    """One row per finished point: mode, rank, DP-sync ms, ms/iter, val loss, MiB/iter."""
    rows = []
    for summary_path in sorted(glob.glob(os.path.join(out, "*.summary.json"))):
        name = os.path.basename(summary_path)[: -len(".summary.json")]
        with open(summary_path) as fh:
            s = json.load(fh)
        mode, _, rank = name.partition("-r")
        rows.append({"point": name, "mode": mode, "rank": int(rank) if rank else None,
                     "grad_sync_ms": s.get("grad_sync_ms"), "ms_per_iter": s.get("ms_per_iter"),
                     "val_loss": s.get("val_loss"),
                     "dp_mib_per_iter": (s.get("dp_bytes_per_iter") or 0) / 2**20,
                     "iterations": s.get("iterations")})
    order = {m: i for i, m in enumerate(("dense", "static", "edgc"))}
    rows.sort(key=lambda r: (order.get(r["mode"], 9), r["rank"] or 0))
    return rows


def table(rows: list[dict]) -> str:
    def f(v, spec):
        return "—" if v is None else format(v, spec)

    lines = ["| point | iterations | DP-sync ms | ms/iter | val loss | DP MiB/iter |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['point']} | {r['iterations']} | {f(r['grad_sync_ms'], '.1f')} | "
                     f"{f(r['ms_per_iter'], '.1f')} | {f(r['val_loss'], '.4f')} | "
                     f"{r['dp_mib_per_iter']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("submit")
    s.add_argument("sweep")
    s.add_argument("--dry-run", action="store_true", help="print the sbatch commands only")
    c = sub.add_parser("collect")
    c.add_argument("out")
    args = p.parse_args(argv)
    try:
        if args.command == "submit":
            submit(args.sweep, args.dry_run)
        else:
            rows = collect(args.out)
            if not rows:
                raise SweepError(f"{args.out}: no finished points (*.summary.json)")
            text = table(rows)
            with open(os.path.join(args.out, "sweep.md"), "w") as fh:
                fh.write(text + "\n")
            print(text)
    except SweepError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
