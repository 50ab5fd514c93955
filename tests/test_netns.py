"""The slow-link harness: rate parsing, the alpha-beta model, and (as root) that the
namespaces it builds carry traffic and are all gone afterwards, also after an error."""

import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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
