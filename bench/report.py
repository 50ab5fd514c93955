"""Write a benchmark's section of BENCHMARKS.md (replacing its previous run), with the
machine and the date."""

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


def run_pretrain(name: str, flags: list, out: str, iters: int, reuse: bool = False,
                 script: str = "pretrain_gpt2_edgc.py", launch=None):
    """One training run of the benchmark: ``runs/.../NAME.jsonl`` → (records, summary);
    ``reuse`` takes an earlier run's files when they exist. ``launch(cmd) -> exit code``
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
        if launch is None:
            subprocess.run(cmd, cwd=ROOT, check=True)
        elif launch(cmd) != 0:
            raise RuntimeError(f"benchmark run {name} failed")
    with open(metrics) as fh:
        records = [json.loads(line) for line in fh if line.strip()]
    with open(summary) as fh:
        return records, json.load(fh)
