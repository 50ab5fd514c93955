"""One rule for every verdict (issue 80): in a section a benchmark writes into BENCHMARKS.md,
"faster", "slower" and "not resolved" stand only behind a paired range that shows the
rule (``median (min–max)× verdict``: faster only where the whole printed range is below 1,
slower only where it is above, not resolved where it holds 1), or in a sentence that
states the rule; "no difference" and overlapping spreads are no verdict at all. The
written notes inside a section are the developers' prose, read by review, not here."""

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

VERDICT = re.compile(r"\b(faster|slower|not resolved)\b")
NO_VERDICT = re.compile(r"\bno difference\b|\bspreads? overlap|\boverlapping spread", re.I)
NUM = r"\d+(?:\.\d+)?"
#: ``0.92 (0.80–0.99)× faster``, and the slow-link table's ``1.09x [0.99–1.11] ✗ (not resolved)``
PAIRED = re.compile(rf"(?P<med>{NUM}) \((?P<lo>{NUM})–(?P<hi>{NUM})\)× "
                    rf"(?P<word>faster|slower|not resolved)\b|"
                    rf"(?P<med2>{NUM})x \[(?P<lo2>{NUM})–(?P<hi2>{NUM})\] [✓✗] "
                    rf"\((?P<word2>faster|slower|not resolved)\)")
RULE = re.compile(r"only where|otherwise")


def generated_sections(text: str) -> dict:
    """``{name: body}`` of every ``<!-- bench:NAME -->`` section, its notes left out."""
    out = {}
    for m in re.finditer(r"<!-- bench:(\w+) -->(.*?)<!-- /bench:\1 -->", text, re.S):
        out[m.group(1)] = re.sub(r"<!-- notes:\w+ -->.*?<!-- /notes:\w+ -->", "",
                                 m.group(2), flags=re.S)
    return out


def unpaired_verdicts(body: str) -> list:
    """The lines of ``body`` with a verdict the rule does not back, and why."""
    wrong = []
    for line in body.splitlines():
        if NO_VERDICT.search(line):
            wrong.append(("no verdict by the rule", line))
            continue
        backed = list(PAIRED.finditer(line))
        for m in backed:
            lo, hi = float(m["lo"] or m["lo2"]), float(m["hi"] or m["hi2"])
            ok = {"faster": hi < 1.0, "slower": lo > 1.0,
                  "not resolved": lo <= 1.0 <= hi}[m["word"] or m["word2"]]
            if not ok:
                wrong.append((f"{m.group(0)}: the printed range does not show it", line))
        if len(VERDICT.findall(line)) > len(backed) and not RULE.search(line):
            wrong.append(("a verdict without its paired range", line))
    return wrong


def test_the_checker_catches_what_the_rule_forbids():
    assert unpaired_verdicts("| 0.92 (0.80–0.99)× faster | 1.10 (1.01–1.30)× slower |") == []
    assert unpaired_verdicts("| 0.96 (0.94–1.02)× not resolved |") == []
    assert unpaired_verdicts("faster or slower only where every paired ratio is below 1") == []
    assert len(unpaired_verdicts("| 0.96 (0.94–1.00)× faster |")) == 1      # 1.00 is not < 1
    assert len(unpaired_verdicts("| 0.96 (0.94–1.02)× faster |")) == 1
    assert len(unpaired_verdicts("| 0.93 | after faster |")) == 1            # no paired range
    assert len(unpaired_verdicts("the two spreads overlap: no difference")) == 1


@pytest.mark.parametrize("name", sorted(generated_sections(
    open(os.path.join(ROOT, "BENCHMARKS.md")).read())))
def test_every_generated_verdict_follows_the_paired_rule(name):
    body = generated_sections(open(os.path.join(ROOT, "BENCHMARKS.md")).read())[name]
    assert unpaired_verdicts(body) == []
