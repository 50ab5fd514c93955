"""Write a benchmark's section of BENCHMARKS.md (replacing its previous run), with the
machine and the date."""

import contextlib
import datetime
import json
import os
import platform
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(ROOT, "BENCHMARKS.md")
HEADER = ("# Benchmarks\n\nEach section is written by the command it names; rerun it to "
          "refresh the figures. Ratios are measured side by side in one run; absolute times "
          "on CPU are indicative only.\n")


def machine() -> str:
    import torch

    try:
        from megatron.core import package_info
        mcore = package_info.__version__
    except Exception:
        mcore = "?"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            names = [l.split(":", 1)[1].strip() for l in fh if l.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    from megatron_edgc.config.host import cpu_bf16

    # bf16 verdicts hold only where the CPU has bf16 instructions (issue 80): say which
    bf16 = "native bf16" if cpu_bf16()[0] else "no native bf16"
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{cpu}, {os.cpu_count()} cores ({bf16}), {gpu}; Python "
            f"{platform.python_version()}, torch {torch.__version__}, megatron-core {mcore}")


def write_section(name: str, title: str, command: str, body: str,
                  stamp: str | None = None) -> None:
    """Replace (or append) the section ``name`` of BENCHMARKS.md. ``stamp`` says when and
    where the figures were measured when that was not here and now (a lent GPU's JSON
    rendered on this machine); by default the current date and this machine."""
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    text = open(BENCHMARKS).read() if os.path.exists(BENCHMARKS) else HEADER
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
    # The written analysis (between the notes markers) survives a rerun: the body's
    # ``<!-- notes -->`` placeholder takes the previous section's notes.
    n_start, n_end = f"<!-- notes:{name} -->", f"<!-- /notes:{name} -->"
    old = pattern.search(text)
    notes = re.search(re.escape(n_start) + "(.*?)" + re.escape(n_end), old.group(0), re.S) \
        if old else None
    body = body.replace("<!-- notes -->", f"{n_start}{notes.group(1) if notes else chr(10)}"
                                          f"{n_end}")
    if stamp is None:
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC") \
            + "; " + machine()
    section = (f"{start}\n## {title}\n\n`{command}` — {stamp}\n\n"
               f"{body.strip()}\n{end}")
    text = pattern.sub(lambda _: section, text) if pattern.search(text) else \
        text.rstrip() + "\n\n" + section + "\n"
    with open(BENCHMARKS, "w") as fh:
        fh.write(text)


#: The code a benchmark run can execute (issue 93): the package (its configs in it), the
#: trainer, the benchmark's own code and the scripts; committed results are data, not code.
STAMPED_CODE = ["megatron_edgc", "pretrain_gpt2_edgc.py", "configs", "bench",
                ":(exclude)bench/results", "scripts"]


def _git(*args, ok=(0,)) -> str | None:
    """``git ARGS`` in the checkout: its stdout, or None where git fails (no checkout, an
    unknown commit)."""
    try:
        proc = subprocess.run(["git", *args], cwd=ROOT, capture_output=True)
    except OSError:
        return None
    return proc.stdout.decode("utf-8", "surrogateescape") if proc.returncode in ok else None


def code_stamp() -> dict | None:
    """The code a run launched now executes (issue 93): ``{"commit": HEAD's full hash,
    "diff": sha256 (16 hex) of the uncommitted changes to :data:`STAMPED_CODE` (``git diff
    HEAD`` and the untracked files' contents) or None when there are none, "dirty": the
    changed paths}``; None outside a git checkout. Every record of a run that
    :func:`run_pretrain` starts carries it as ``"code"``."""
    import hashlib

    commit = _git("rev-parse", "HEAD")
    if not commit:
        return None
    diff = _git("diff", "HEAD", "--binary", "--", *STAMPED_CODE) or ""
    dirty = set((_git("diff", "HEAD", "--name-only", "--", *STAMPED_CODE) or "").split())
    untracked = sorted((_git("ls-files", "--others", "--exclude-standard", "--",
                             *STAMPED_CODE) or "").split())
    h = hashlib.sha256(diff.encode("utf-8", "surrogateescape"))
    for path in untracked:
        h.update(f"\0{path}\0".encode())
        with contextlib.suppress(OSError), open(os.path.join(ROOT, path), "rb") as fh:
            h.update(fh.read())
    dirty.update(untracked)
    return {"commit": commit.strip(), "diff": h.hexdigest()[:16] if dirty else None,
            "dirty": sorted(dirty)}


def stamp_text(stamp: dict | None) -> str:
    """A stamp as a report names it: the commit's 12 hex, ``+diff HASH`` where the code
    had uncommitted changes; "unstamped" for a run recorded before stamps (issue 93)."""
    if not stamp:
        return "unstamped"
    return stamp["commit"][:12] + (f"+diff {stamp['diff']}" if stamp.get("diff") else "")


def stamp_files(path: str, stamp: dict | None) -> None:
    """Put ``stamp`` into every record of the metrics file ``path`` and into its summary
    (``"code"``), the run's own keys kept."""
    summary = os.path.splitext(path)[0] + ".summary.json"
    with open(path) as fh:
        lines = [json.loads(line) for line in fh if line.strip()]
    with open(path, "w") as fh:
        for record in lines:
            fh.write(json.dumps(dict(record, code=stamp)) + "\n")
    if os.path.exists(summary):
        with open(summary) as fh:
            data = json.load(fh)
        data["code"] = stamp
        with open(summary, "w") as fh:
            json.dump(data, fh, indent=2)


def run_pretrain(name: str, flags: list, out: str, iters: int, reuse: bool = False,
                 script: str = "pretrain_gpt2_edgc.py", launch=None):
    """One training run of the benchmark: ``runs/.../NAME.jsonl`` → (records, summary),
    each record and the summary stamped with the code it ran (:func:`code_stamp`, taken at
    the launch); ``reuse`` takes an earlier run's files when they exist (as they were). ``launch(cmd) -> exit code``
    starts the ranks some other way (bench/netns.py: one per network namespace)."""
    metrics = os.path.join(out, f"{name}.jsonl")
    summary = os.path.splitext(metrics)[0] + ".summary.json"
    if reuse and os.path.exists(summary):
        print(f"=== {name}: reusing {metrics}", flush=True)
    else:
        cmd = [sys.executable, os.path.join(ROOT, script), "--train-iters",
               str(iters), "--log-interval", str(max(1, iters // 4)), "--metrics-file",
               metrics, *flags]
        print(f"=== {name}: {' '.join(flags) or 'dense'}", flush=True)
        stamp = code_stamp()   # the code the run executes, taken as it starts
        if launch is None:
            subprocess.run(cmd, cwd=ROOT, check=True)
        elif launch(cmd) != 0:
            raise RuntimeError(f"benchmark run {name} failed")
        stamp_files(metrics, stamp)
    with open(metrics) as fh:
        records = [json.loads(line) for line in fh if line.strip()]
    with open(summary) as fh:
        return records, json.load(fh)
