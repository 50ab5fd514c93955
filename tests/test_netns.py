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
            codes = net.run([sys.executable, str(script)], env={"EDGC_NUMEL": "1000"},
                            timeout=120)
            assert codes == [0, 0]
            qdisc = subprocess.run(["tc", "qdisc", "show", "dev", net.host_dev[0]],
                                   capture_output=True, text=True).stdout
            assert "tbf" in qdisc and "100Mbit" in qdisc
            raise Boom()
    except NetnsUnavailable as exc:  # e.g. a container without CAP_NET_ADMIN
        pytest.skip(str(exc))
    except Boom:
        pass
    assert _ours(net) == []


def test_not_root_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(NetnsUnavailable, match="root"):
        with ShapedNetwork(2, "1gbit"):
            pass
