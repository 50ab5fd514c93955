#!/usr/bin/env python
"""Before / after the host syncs left the compressed step (issue 26), on emulated links.

    python bench/sync_free_before_after.py --before DIR --after DIR

``DIR`` is the ``--out`` of one ``bench/slow_links.py`` run on each checkout, same flags
(e.g. ``--configs tiny --rates 300mbit --repeats 3``), run one after the other on an idle
machine. Per (config, link, mode) it puts the two runs' medians side by side with their
(min–max) over repetitions, and calls a difference only where the ranges do not overlap.
Writes the ``sync_free`` section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def load(path: str) -> dict:
    with open(os.path.join(path, "results.json")) as fh:
        return json.load(fh)


def verdict(before: list, after: list) -> str:
    """The one rule (:func:`bench.peers.ratio_verdict`) over every pair of an after and a
    before repetition (the two ran one after the other: any pairing is as good as
    another, so all of them): after faster only where every ratio is below 1."""
    from bench.peers import ratio_verdict

    if not before or not after:
        return "–"
    return ratio_verdict([a / b for a in after for b in before])


def cell(values: list, median: float | None) -> str:
    values = [v for v in values if v is not None]
    if median is None or not values:
        return "–"
    return f"{median:.1f} ({min(values):.1f}–{max(values):.1f})"


def render(before: dict, after: dict, before_label: str, after_label: str) -> str:
    rows = ["| config · link · mode | ms/iter before | ms/iter after | DP-sync ms before | "
            "DP-sync ms after | ms/iter after / before, every pair |",
            "|---|---|---|---|---|---|"]
    for key, a in after["results"].items():
        b = before["results"].get(key)
        if b is None:
            continue
        rows.append(f"| {key.replace('|', ' · ')} | {cell(b['iter_ms_runs'], b['iter_ms'])} | "
                    f"{cell(a['iter_ms_runs'], a['iter_ms'])} | "
                    f"{cell(b['sync_ms_runs'], b['sync_ms'])} | "
                    f"{cell(a['sync_ms_runs'], a['sync_ms'])} | "
                    f"{verdict(b['iter_ms_runs'], a['iter_ms_runs'])} |")
    link = "emulated (network namespaces, tbf)" if after.get("emulated") else \
        "**modelled** (loopback + alpha-beta)"
    return (f"Before: `{before_label}`; after: `{after_label}`. Both `bench/slow_links.py` runs "
            f"with the same flags, {after['iters']} iterations, {after['repeats']} "
            f"repetitions each (medians, min–max), links {link}, one after the other on the "
            "same idle machine. The ratio pairs every after repetition with every before "
            "one: faster or slower only where every ratio is on one side of 1, not resolved "
            "otherwise.\n\n" + "\n".join(rows) + "\n\n<!-- notes -->\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="bench/slow_links.py --out of the old code")
    ap.add_argument("--after", required=True, help="... of the new code")
    ap.add_argument("--before-label", default="before")
    ap.add_argument("--after-label", default="after")
    args = ap.parse_args(argv)
    from bench.report import write_section

    body = render(load(args.before), load(args.after), args.before_label, args.after_label)
    write_section("sync_free", "Host syncs out of the compressed step: before / after",
                  f"python bench/sync_free_before_after.py --before {args.before} "
                  f"--after {args.after}", body)
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
