"""The slow-link harness: rate parsing, the alpha-beta model, and (as root) that the
namespaces it builds carry traffic and are all gone afterwards, also after an error."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.netns import (_SELFTEST, NetnsUnavailable, ShapedNetwork,  # noqa: E402
                         alpha_beta_allreduce_s, rate_bits)


def test_rates_and_model():
    assert rate_bits("100mbit") == 1e8 and rate_bits("1Gbit") == 1e9
    with pytest.raises(ValueError, match="100mbit"):
        rate_bits("fast")
    # 4 ranks, 6.4 MB at 100 Mbit: 6 alpha + 1.5 x 6.4e6 / (0.94 x 12.5e6 B/s)
    assert alpha_beta_allreduce_s(6.4e6, 4, "100mbit") == pytest.approx(
        6 * 2.5e-4 + 1.5 * 6.4e6 / (0.94 * 12.5e6))
    assert alpha_beta_allreduce_s(1e9, 1, "1gbit") == 0.0


def _ours(net):
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [n for n in net.namespaces if n in names] + \
        [d for d in [net.bridge, *net.host_dev] if os.path.exists(f"/sys/class/net/{d}")]


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_namespaces_connect_and_are_removed_even_on_error(tmp_path):
    class Boom(Exception):
        pass

    net = ShapedNetwork(2, "100mbit")
    try:
        with net:
            assert len(_ours(net)) == 2 + 1 + 2
            # a real gloo all-reduce between the namespaces, over the shaped interfaces
            script = tmp_path / "allreduce.py"
            script.write_text(_SELFTEST)
            log = tmp_path / "ranks.log"
            with open(log, "w") as fh:
                codes = net.run([sys.executable, str(script)], env={"EDGC_NUMEL": "1000"},
                                timeout=120, stdout=fh)
            assert codes == [0, 0]
            # the peers' names resolve inside the namespaces: no c10d hostname warning
            assert "hostname of the client socket" not in log.read_text()
            assert all(os.path.isfile(f"/etc/netns/{ns}/hosts") for ns in net.namespaces)
            qdisc = subprocess.run(["tc", "qdisc", "show", "dev", net.host_dev[0]],
                                   capture_output=True, text=True).stdout
            assert "tbf" in qdisc and "100Mbit" in qdisc
            raise Boom()
    except NetnsUnavailable as exc:  # e.g. a container without CAP_NET_ADMIN
        pytest.skip(str(exc))
    except Boom:
        pass
    assert _ours(net) == []
    assert not any(os.path.exists(f"/etc/netns/{ns}") for ns in net.namespaces)


def test_not_root_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(NetnsUnavailable, match="root"):
        with ShapedNetwork(2, "1gbit"):
            pass


_TWO_LEVEL = r"""
import os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank, numel = dist.get_rank(), int(os.environ["EDGC_NUMEL"])
intra = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
inter = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
x = torch.ones(numel)
phase = os.environ["EDGC_PHASE"]
dist.barrier()
dist.all_reduce(x, group=intra if phase == "intra" else inter)
dist.barrier()
assert x[0].item() == 2.0
dist.destroy_process_group()
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
@pytest.mark.parametrize("phase", ["intra", "inter"])
def test_two_level_cluster_shapes_only_the_links_between_instances(tmp_path, phase):
    """Two namespaces of two ranks (the partial distributed optimizer's instances): an
    all-reduce inside an instance puts nothing on the shaped links, one across instances
    puts its ring's bytes there (veth counters): 2 pairs x 2 ranks x 4 MB, plus at most
    10 % of rendezvous, barriers and TCP headers."""
    script = tmp_path / "two_level.py"
    script.write_text(_TWO_LEVEL)
    numel = 1 << 20
    with ShapedNetwork(4, "1gbit", ranks_per_namespace=2) as net:
        assert len(net.namespaces) == 2
        before = net.link_bytes()
        codes = net.run([sys.executable, str(script)], timeout=120,
                        env={"EDGC_NUMEL": str(numel), "EDGC_PHASE": phase})
        assert codes == [0, 0, 0, 0]
        crossed = net.link_bytes() - before
    payload = 2 * 2 * 4 * numel    # two inter pairs, each rank sends its 4 MB once
    if phase == "intra":
        assert crossed < 0.05 * payload, crossed   # rendezvous and barriers only
    else:
        assert payload < crossed < 1.1 * payload, crossed


#: 1-based iterations after which the links change: fast -> 25 Mbit -> fast.
SLOW_AT, FAST_AT, WINDOW, ITERS = 8, 18, 4, 28


def bypass_job(corpus_data, metrics, per_namespace: int, iters: int, rank: int = 16) -> list:
    """The bypass's test job: 4 ranks of the tiny model (2 layers, fp32), DP 4 (two
    distributed-optimizer instances of 2 where ``per_namespace`` is 2), static at ``rank``
    with the bypass on, its link refitted every ``WINDOW`` iterations and every window's first
    iteration sent the other way."""
    layout = ["--pipeline-model-parallel-size", "1", "--data-parallel-size", "4"]
    if per_namespace > 1:
        layout += ["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2"]
    return [sys.executable, os.path.join(ROOT, "pretrain_gpt2_edgc.py"),
            "--config", os.path.join(ROOT, "configs", "tiny-cpu.yaml"), *layout,
            "--data-path", corpus_data["prefix"], "--vocab-file", corpus_data["vocab_file"],
            "--tokenizer-type", "CorpusBPETokenizer", "--num-layers", "2", "--no-bf16",
            "--train-iters", str(iters), "--lr-warmup-iters", "2", "--eval-interval", "1000",
            "--eval-iters", "1", "--log-interval", "1", "--metrics-file", str(metrics),
            "--edgc-mode", "static", "--edgc-rank", str(rank), "--edgc-bypass", "auto",
            "--edgc-link-window", str(WINDOW), "--edgc-link-explore", "1"]


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
@pytest.mark.parametrize("per_namespace", [1, 2], ids=["flat", "two-level"])
def test_the_bypass_follows_a_link_that_changes(corpus_data, tmp_path, per_namespace):
    """4 ranks on shaped links whose rate changes under the running job (2 Gbit/s ->
    25 Mbit/s -> 2 Gbit/s): flat (every rank's link shaped) and two-level (2 instances of
    2 ranks, the slow hop shaped). Dense on the fast link (compressing costs more than it
    saves), compressed on the slow one; each change is followed at the first window
    boundary after a whole window at the new rate — within one window of evidence, and
    never before a change — and nothing hangs.

    Static r16 at 25 Mbit, where compressing pays clearly on every CPU the machines come
    with, alone and beside other work. On an AMD EPYC of family 25 (2 cores, issue 80)
    the math takes 65-75 ms here at any rank (it does not shrink with the rank on this
    model), and 105-135 ms beside two busy processes: at 100 Mbit the two choices were
    within 5 % at r48 alone (168 against 176 ms), and at r16 beside other work the
    compressed syncs (181-212 ms) were no faster than the dense ones (177-185): there the
    bypass rightly stays dense, and this test would ask the wrong answer of it. Every
    window's first iteration sends the bucket
    the other way (``--edgc-link-explore 1``): on the two-level hop the compressed
    transfers (65 and 124 kB) are latency-bound and run alike on both rates, so only a
    dense transfer shows that the link got fast again; the decision in force is what is
    asserted, and the explored iterations are exactly the window starts."""
    import json

    from bench.netns import RateSchedule

    metrics, log = tmp_path / "m.jsonl", tmp_path / "ranks.log"
    argv = bypass_job(corpus_data, metrics, per_namespace, ITERS)
    rates = RateSchedule([(SLOW_AT, "25mbit"), (FAST_AT, "2gbit")], str(log))
    with ShapedNetwork(4, "2gbit", ranks_per_namespace=per_namespace) as net:
        with open(log, "w") as out:
            codes = net.run(argv, env={"OMP_NUM_THREADS": "1"}, timeout=240, stdout=out,
                            rates=rates, cwd=ROOT)
    text = log.read_text()
    assert codes == [0, 0, 0, 0], text[-3000:]
    assert [rate for _, rate, _ in rates.applied] == ["25mbit", "2gbit"]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["iteration"] for r in records] == list(range(1, ITERS + 1))
    # the decision in force: what went dense, but the other way on an explored iteration
    explored = [r["iteration"] for r in records if r["dp_bypass_explored"]]
    assert explored == list(range(WINDOW + 1, ITERS + 1, WINDOW)), explored
    dense = {r["iteration"]: (r["dp_bypassed_buckets"] > 0) != r["dp_bypass_explored"]
             for r in records}
    changed = [seen for seen, _, _ in rates.applied]   # the change lands after these

    def follows(after: int) -> int:
        """The first window boundary whose window ran entirely after ``after``."""
        return -(-after // WINDOW) * WINDOW + WINDOW + 1

    slow_from, fast_from = follows(changed[0]), follows(changed[1])
    assert all(dense[i] for i in range(1, changed[0] + 1)), dense       # fast: dense
    assert not any(dense[i] for i in range(slow_from, changed[1] + 1)), dense
    assert all(dense[i] for i in range(fast_from, ITERS + 1)), dense
    flips = [i for i in range(2, ITERS + 1) if dense[i] != dense[i - 1]]
    assert len(flips) == 2, dense                                       # no flapping
    assert all((i - 1) % WINDOW == 0 for i in flips)                    # at boundaries only
    # the rate in force, in every record: fast, then slow from the first flip on
    assert records[slow_from - 1]["dp_link_gbps"] < 0.2 < records[0]["dp_link_gbps"]
    # the start-up line and the progress line say the rate in use
    assert "buckets sent dense (link " in text and "measured at start-up)" in text
    assert re.search(r"\| link [0-9.]+ Gbit/s, 0 dense", text), text[-2000:]


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
@pytest.mark.parametrize("rate,per_namespace,rank",
                         [("25mbit", 1, 16), ("2gbit", 1, 32), ("2gbit", 2, 32)],
                         ids=["25mbit-flat-r16", "2gbit-flat-r32", "2gbit-two-level-r32"])
def test_the_bypass_prices_both_choices_as_they_run(corpus_data, tmp_path, rate,
                                                    per_namespace, rank):
    """Issue 80: the bypass's prices of both choices against their measured syncs, in one
    job on a shaped link: every window's first iteration sends the bucket the other way
    (``--edgc-link-explore 1``), so both are measured in the job. What decides is the
    difference of the two (the wait for the slowest replica and, on the two-level hop,
    the dense reduce-scatter inside the instance are in both measured syncs and in
    neither price; the compressed path's own collectives inside the instance are in its
    price, as its local work): the predicted saving off the measured one by at most half
    the slower choice's measured sync, and the decision in force the faster choice
    measured, from the first refit on. One case where compressing pays and two where it
    costs (flat, and two-level at r32). Half, not a quarter: 4 ranks on 2 cores wait for
    each other longer on the compressed path's CPU-bound math, a wait in the measured sync
    that no price holds, so a run on a loaded machine reads a prediction short by about a
    quarter of the slower sync (2 Gbit flat, AMD EPYC family 25 model 17, 2026-12-06, 1 run
    of 5 failing the quarter: 24 / 62 measured against 13 / 35 predicted, the decision
    dense, right); a price without the compressed path's local work (most of its 27-55 ms
    predicted at 2 Gbit) would miss by more. Measured dense / compressed
    against predicted, ms, AMD EPYC family 25 model 17 (2 cores), 2026-12-05: 25 Mbit flat
    660 / 86 against 644 / 127 alone, 664 / 109 against 647 / 140 beside two busy
    processes; 2 Gbit flat 20 / 36 against 12 / 29 alone, 36 / 78 against 19 / 55 beside
    them; 2 Gbit two-level 18 / 36 against 6 / 27 alone, 35 / 73 against 6 / 36 beside
    them (before the instance's collectives were priced, 1 Gbit two-level read 23 / 37
    against 10 / 13 alone: a tie predicted where dense was clearly faster). The same link
    declared to a job on loopback (``--edgc-link-gbps``, ``--edgc-link-latency-ms``: the
    rate and latency the job measured) decides alike. 2 Gbit flat runs at r32 since issue
    93 sped the host's step: at r16 it was no longer a clear choice (23 / 28 measured, Intel
    Xeon family 6 model 207, 2026-12-08); at r32 17-19 / 34-37 alone (3 runs), 24 / 67
    beside two busy processes."""
    import json
    import statistics

    metrics, log = tmp_path / "m.jsonl", tmp_path / "ranks.log"
    argv = bypass_job(corpus_data, metrics, per_namespace, 24, rank)
    with ShapedNetwork(4, rate, ranks_per_namespace=per_namespace) as net:
        with open(log, "w") as out:
            codes = net.run(argv, env={"OMP_NUM_THREADS": "1"}, timeout=240, stdout=out,
                            cwd=ROOT)
    assert codes == [0, 0, 0, 0], log.read_text()[-3000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()][WINDOW:]
    sent_dense = {r["iteration"]: r["dp_bypassed_buckets"] > 0 for r in records}
    in_force = {(r["dp_bypassed_buckets"] > 0) != r["dp_bypass_explored"] for r in records}
    measured = {choice: [r["dp_sync_ms"][0] for r in records
                         if sent_dense[r["iteration"]] == choice] for choice in (True, False)}
    assert min(len(v) for v in measured.values()) >= 4, measured
    dense_ms, compressed_ms = (statistics.median(measured[c]) for c in (True, False))
    predicted = [statistics.median(r[f"dp_predicted_{c}_ms"] for r in records)
                 for c in ("dense", "compressed")]
    saving, predicted_saving = dense_ms - compressed_ms, predicted[0] - predicted[1]
    figures = (dense_ms, compressed_ms, predicted)
    assert abs(predicted_saving - saving) <= 0.5 * max(dense_ms, compressed_ms), figures
    assert abs(saving) > 0.25 * max(dense_ms, compressed_ms), figures   # a clear choice
    assert in_force == {saving < 0}, figures                            # the faster, always
    # the same link declared (its rate and latency as the job measured them), on loopback:
    # the same decisions (bench/peers.py's loss runs take a link's decisions so)
    import warm

    twin_metrics = tmp_path / "declared.jsonl"
    link = {"--edgc-link-gbps": records[-1]["dp_link_gbps"],
            "--edgc-link-latency-ms": records[-1]["dp_link_alpha_ms"]}
    twin = bypass_job(corpus_data, twin_metrics, per_namespace, 12, rank)
    twin[-1:] = ["1"] + [str(v) for kv in link.items() for v in kv]
    proc = warm.run([twin[0], "-m", "torch.distributed.run", "--standalone",
                     "--nproc-per-node", "4", *twin[1:]], cwd=ROOT, timeout=240,
                    env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    declared = [json.loads(line) for line in twin_metrics.read_text().splitlines()][WINDOW:]
    assert [r["dp_link_gbps"] for r in declared] == \
        pytest.approx([link["--edgc-link-gbps"]] * len(declared))
    assert {(r["dp_bypassed_buckets"] > 0) != r["dp_bypass_explored"]
            for r in declared} == in_force, (link, figures)
