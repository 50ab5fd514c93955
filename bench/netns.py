#!/usr/bin/env python
"""Slow links for real: one network namespace per training rank, joined by a bridge,
every link shaped with ``tc … tbf`` (FINDINGS.md "Slow links on one machine").

    sudo python bench/netns.py --rate 1gbit --selftest     # measure gloo all-reduce
    sudo python bench/netns.py --rate 100mbit --ranks-per-namespace 2 --selftest

Two levels (``ranks_per_namespace`` > 1, the partial distributed optimizer's cluster): the
ranks of one instance share a namespace, so traffic between them stays on that
namespace's own stack (fast, unshaped), and only traffic between namespaces crosses the
shaped veth links: the slow hop. Its bytes are read from the veth counters
(:meth:`ShapedNetwork.link_bytes`), not computed.

Each rank ``i`` gets namespace ``<tag>-r<i>`` holding one end of a veth pair with address
10.<net>.0.<i+1>/24; the other end joins the bridge ``<tag>br`` in the root namespace
(no address there, so nothing on the host changes). Both ends are shaped to the rate, so
every rank's egress and ingress run at the link rate. The tbf burst is 128 kB: with TSO/GSO
on (no ethtool here to turn it off) the kernel hands tbf 64 kB super-packets, and a 32 kB
burst cost 2.6x the line time (measured: 4-rank gloo all-reduce of 64 MB at 1 Gbit
2.16 s vs 0.81 s with 128 kB, the latter within 1 % of the alpha-beta model; 6.4 MB at
100 Mbit 0.79 s vs 0.82 s modelled). Ranks run inside their namespace
with ``GLOO_SOCKET_IFNAME`` set (gloo binds to 127.0.0.1 otherwise) and the torchrun
environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` = rank 0's address).

Everything created is recorded and removed on exit, on an exception and on SIGINT/SIGTERM;
the tool only ever names the namespaces, links and qdiscs it made. Where namespaces can't
be created (not root, no ``ip``), :class:`NetnsUnavailable` says why, and the benchmark
falls back to the alpha-beta model (its figures labelled "modelled").
"""

from __future__ import annotations

import argparse
import atexit
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from typing import Optional, Sequence


class NetnsUnavailable(RuntimeError):
    """Namespaces/bridges/tbf cannot be set up here; the reason is the message."""


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def rate_bits(rate: str) -> float:
    """'100mbit' / '1gbit' / '300Mbit' → bits per second."""
    r = rate.strip().lower()
    for suffix, mult in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0)):
        if r.endswith(suffix):
            return float(r[:-len(suffix)]) * mult
    raise ValueError(f"rate must look like 100mbit or 1gbit, got {rate!r}")


class ShapedNetwork:
    """``with ShapedNetwork(4, "1gbit") as net: net.run(argv)`` — ``rate=None``: unshaped;
    ``ranks_per_namespace``: consecutive ranks sharing a namespace (one fast domain)."""

    def __init__(self, n_ranks: int, rate: Optional[str], ranks_per_namespace: int = 1):
        if n_ranks < 1:
            raise ValueError("need at least one rank")
        if ranks_per_namespace < 1 or n_ranks % ranks_per_namespace:
            raise ValueError(f"{ranks_per_namespace} ranks per namespace must divide "
                             f"{n_ranks} ranks")
        if rate is not None:
            rate_bits(rate)
        self.ranks, self.per_ns = n_ranks, ranks_per_namespace
        n_ranks //= ranks_per_namespace   # below: namespaces
        self.n, self.rate = n_ranks, rate
        pid = os.getpid() % 100000
        self.tag = f"e{pid}"
        self.net = 64 + pid % 128                     # 10.<net>.0.0/24 inside the namespaces
        self.bridge = f"{self.tag}br"
        self.namespaces = [f"{self.tag}-r{i}" for i in range(n_ranks)]
        self.ns_dev = [f"{self.tag}n{i}" for i in range(n_ranks)]
        self.host_dev = [f"{self.tag}h{i}" for i in range(n_ranks)]
        self._made_ns: list = []
        self._made_bridge = False
        self._old_handlers: dict = {}

    def address(self, i: int) -> str:
        """Namespace ``i``'s address."""
        return f"10.{self.net}.0.{i + 1}"

    def link_bytes(self) -> int:
        """Bytes delivered so far over the shaped links: every byte between namespaces
        leaves the bridge through the host end of its destination's veth (tx counter)."""
        total = 0
        for dev in self.host_dev:
            with open(f"/sys/class/net/{dev}/statistics/tx_bytes") as fh:
                total += int(fh.read())
        return total

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> "ShapedNetwork":
        if os.geteuid() != 0:
            raise NetnsUnavailable("network namespaces need root (run the benchmark as root)")
        if shutil.which("ip") is None or shutil.which("tc") is None:
            raise NetnsUnavailable("the ip and tc commands (iproute2) are not installed")
        atexit.register(self.close)
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            self._create()
        except (subprocess.CalledProcessError, OSError) as exc:
            self.close()
            detail = getattr(exc, "stderr", "") or str(exc)
            raise NetnsUnavailable(f"could not build the namespaces: {detail.strip()}")
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _on_signal(self, signum, frame):
        self.close()
        raise KeyboardInterrupt(f"signal {signum}: namespaces removed")

    def _hosts_file(self, ns: str) -> str:
        return os.path.join("/etc/netns", ns, "hosts")

    def _create(self) -> None:
        # ``ip netns exec`` bind-mounts /etc/netns/<ns>/hosts over /etc/hosts: with every
        # namespace's address named there, c10d resolves its peers' sockets instead of
        # warning "The hostname of the client socket cannot be retrieved" in every rank.
        # Its sockets are dual-stack: the IPv4-mapped form needs a line of its own (glibc
        # does not map it onto the IPv4 line; measured: getnameinfo EAI_AGAIN without it)
        hosts = "127.0.0.1 localhost\n" + "".join(
            f"{self.address(i)} {ns}\n::ffff:{self.address(i)} {ns}\n"
            for i, ns in enumerate(self.namespaces))
        _ip("link", "add", self.bridge, "type", "bridge")
        self._made_bridge = True
        _ip("link", "set", self.bridge, "up")
        for i, ns in enumerate(self.namespaces):
            _ip("netns", "add", ns)
            self._made_ns.append(ns)
            os.makedirs(os.path.dirname(self._hosts_file(ns)), exist_ok=True)
            with open(self._hosts_file(ns), "w") as fh:
                fh.write(hosts)
            _ip("link", "add", self.host_dev[i], "type", "veth", "peer", "name", self.ns_dev[i])
            _ip("link", "set", self.ns_dev[i], "netns", ns)
            _ip("link", "set", self.host_dev[i], "master", self.bridge)
            _ip("link", "set", self.host_dev[i], "up")
            _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", self.ns_dev[i])
            _ip("-n", ns, "link", "set", self.ns_dev[i], "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            if self.rate is not None:
                self._tbf("add", i, self.rate)

    def _tbf(self, verb: str, i: int, rate: str) -> None:
        """``tc qdisc <verb>`` the tbf of namespace ``i``'s link, both ends."""
        tbf = ["root", "tbf", "rate", rate, "burst", "128kb", "latency", "1000ms"]
        subprocess.run(["tc", "qdisc", verb, "dev", self.host_dev[i], *tbf],
                       capture_output=True, text=True, check=True)
        subprocess.run(["ip", "netns", "exec", self.namespaces[i], "tc", "qdisc", verb, "dev",
                        self.ns_dev[i], *tbf], capture_output=True, text=True, check=True)

    def set_rate(self, rate: str) -> None:
        """Change every shaped link's rate now (running jobs keep their connections)."""
        rate_bits(rate)
        if self.rate is None:
            raise ValueError("an unshaped network has no rate to change")
        for i in range(self.n):
            self._tbf("change", i, rate)
        self.rate = rate

    def close(self) -> None:
        """Remove what this object made (namespaces take their veth ends and qdiscs)."""
        for ns in reversed(self._made_ns):
            _ip("netns", "del", ns, check=False)
            shutil.rmtree(os.path.dirname(self._hosts_file(ns)), ignore_errors=True)
        self._made_ns = []
        for dev in self.host_dev:  # normally gone with their peers; be sure
            if os.path.exists(f"/sys/class/net/{dev}"):
                _ip("link", "del", dev, check=False)
        if self._made_bridge:
            _ip("link", "del", self.bridge, check=False)
            self._made_bridge = False
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers = {}

    # ------------------------------------------------------------------ running

    def run(self, argv: Sequence[str], port: int = 29511, env: Optional[dict] = None,
            timeout: Optional[float] = None, cwd: Optional[str] = None, stdout=None,
            rates: Optional["RateSchedule"] = None) -> list:
        """Run ``argv`` once per rank inside its namespace (torchrun environment); returns
        the return codes. If one rank fails, the others are stopped. ``stdout``: a file
        the ranks' output and errors go to (default: this process's); ``rates``: link
        rate changes at training iterations, read from that file as it grows."""
        procs = []
        for i in range(self.ranks):
            k = i // self.per_ns                      # the rank's namespace
            rank_env = {**os.environ, **(env or {}), "RANK": str(i),
                        "WORLD_SIZE": str(self.ranks), "LOCAL_RANK": str(i % self.per_ns),
                        "MASTER_ADDR": self.address(0), "MASTER_PORT": str(port),
                        "GLOO_SOCKET_IFNAME": self.ns_dev[k]}
            procs.append(subprocess.Popen(["ip", "netns", "exec", self.namespaces[k], *argv],
                                          env=rank_env, cwd=cwd, stdout=stdout,
                                          stderr=None if stdout is None else
                                          subprocess.STDOUT))
        deadline = None if timeout is None else time.monotonic() + timeout
        codes: list = [None] * len(procs)
        while any(c is None for c in codes):
            if rates is not None:
                rates.poll(self)
            for i, p in enumerate(procs):
                if codes[i] is None:
                    codes[i] = p.poll()
            failed = any(c not in (None, 0) for c in codes)
            late = deadline is not None and time.monotonic() > deadline
            if failed or late:
                for i, p in enumerate(procs):
                    if codes[i] is None:
                        p.kill()
                        codes[i] = p.wait()
                break
            time.sleep(0.05)
        return codes


class RateSchedule:
    """Link rates that change at training iterations: ``[(iteration, rate), ...]``. While
    :meth:`ShapedNetwork.run` waits, :meth:`poll` reads the ranks' output file ``log`` as
    it grows and, once a line names iteration ``i`` or later (the progress line, an
    ``iteration i:`` event or the plug-in's ``EDGC iteration i``), sets that rate.
    :attr:`applied` lists ``(iteration seen, rate, seconds since the first poll)``."""

    _ITERATION = re.compile(r"\biteration\s+(\d+)\b")

    def __init__(self, changes: Sequence[tuple], log: str):
        self.pending = sorted((int(it), rate) for it, rate in changes)
        for _, rate in self.pending:
            rate_bits(rate)
        self.log = log
        self.applied: list = []
        self._offset = 0
        self._latest = 0
        self._t0: Optional[float] = None

    def poll(self, net: "ShapedNetwork") -> None:
        if self._t0 is None:
            self._t0 = time.monotonic()
        if not self.pending or not os.path.exists(self.log):
            return
        with open(self.log, "rb") as fh:
            fh.seek(self._offset)
            data = fh.read()
        cut = data.rfind(b"\n") + 1          # whole lines only
        self._offset += cut
        for m in self._ITERATION.finditer(data[:cut].decode(errors="replace")):
            self._latest = max(self._latest, int(m.group(1)))
        while self.pending and self._latest >= self.pending[0][0]:
            _, rate = self.pending.pop(0)
            net.set_rate(rate)
            self.applied.append((self._latest, rate, time.monotonic() - self._t0))


def alpha_beta_allreduce_s(nbytes: float, n_ranks: int, rate: str, alpha_s: float = 2.5e-4,
                           efficiency: float = 0.94) -> float:
    """Ring all-reduce time ``2(N−1)α + 2(N−1)/N · bytes / B`` with ``B = 0.94 × rate``
    (FINDINGS.md: within 5 % of gloo on tbf links)."""
    if n_ranks < 2:
        return 0.0
    bandwidth = efficiency * rate_bits(rate) / 8
    return 2 * (n_ranks - 1) * alpha_s + 2 * (n_ranks - 1) / n_ranks * nbytes / bandwidth


_SELFTEST = r"""
import os, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
per = int(os.environ.get("EDGC_PER_NS", "1")); world = dist.get_world_size(); rank = dist.get_rank()
x = torch.ones(int(os.environ["EDGC_NUMEL"]))
groups = {"all": None}
if per > 1:  # within a namespace, and across namespaces (one rank of each)
    intra = [dist.new_group(list(range(s, s + per))) for s in range(0, world, per)]
    inter = [dist.new_group(list(range(k, world, per))) for k in range(per)]
    groups = {"intra": intra[rank // per], "inter": inter[rank % per]}
for name, g in groups.items():
    dist.all_reduce(x, group=g)
    t = []
    for _ in range(3):  # until every group's all-reduce is done (they run concurrently)
        dist.barrier(); t0 = time.perf_counter(); dist.all_reduce(x, group=g)
        dist.barrier(); t.append(time.perf_counter() - t0)
    if rank == 0:
        print(f"ALLREDUCE {name} {min(t):.6f}", flush=True)
dist.destroy_process_group()
"""


def two_level_allreduce_s(nbytes: float, n_instances: int, per_namespace: int,
                          rate: str) -> float:
    """The alpha-beta time of ``per_namespace`` concurrent all-reduces of ``nbytes`` (one
    per instance rank, each across ``n_instances`` namespaces): they share each
    namespace's veth, so the link carries ``per_namespace`` times the bytes."""
    return alpha_beta_allreduce_s(nbytes * per_namespace, n_instances, rate)


def selftest(net: "ShapedNetwork", numel: int, per_namespace: int) -> dict:
    """Time gloo all-reduces of ``numel`` fp32 on ``net`` (min of 3, until every rank is
    done): ``{"all": s}``, or with ``per_namespace`` > 1 ``{"intra": s, "inter": s}``
    (every instance's, every instance rank's concurrently), and ``"link_bytes"``."""
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as fh:
        fh.write(_SELFTEST)
    try:
        before = net.link_bytes()
        with tempfile.TemporaryFile("w+") as log:
            codes = net.run([sys.executable, fh.name], stdout=log,
                            env={"EDGC_NUMEL": str(numel),
                                 "EDGC_PER_NS": str(per_namespace)}, timeout=300)
            log.seek(0)
            out = log.read()
    finally:
        os.unlink(fh.name)
    if any(c != 0 for c in codes):
        raise RuntimeError(f"the all-reduce selftest failed ({codes}):\n{out[-2000:]}")
    result = {"link_bytes": net.link_bytes() - before}
    for line in out.splitlines():
        if line.startswith("ALLREDUCE "):
            _, name, secs = line.split()
            result[name] = float(secs)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--rate", default="1gbit", help="tbf rate, e.g. 100mbit, 1gbit; "
                                                   "'none': unshaped")
    p.add_argument("--numel", type=int, default=1_600_000)
    p.add_argument("--ranks-per-namespace", type=int, default=1,
                   help="consecutive ranks sharing a namespace (a fast domain)")
    p.add_argument("--selftest", action="store_true",
                   help="time a gloo all-reduce of 6.4 MB vs the alpha-beta model")
    args = p.parse_args()
    if not args.selftest:
        p.print_help()
        return 0
    numel = args.numel
    rate = None if args.rate == "none" else args.rate
    try:
        with ShapedNetwork(args.ranks, rate, args.ranks_per_namespace) as net:
            result = selftest(net, numel, args.ranks_per_namespace)
    except NetnsUnavailable as exc:
        print(f"namespaces unavailable ({exc})")
        return 0
    per = args.ranks_per_namespace
    for name, secs in result.items():
        if name != "link_bytes":
            print(f"all-reduce {name}: {secs * 1e3:.1f} ms")
    print(f"bytes over the shaped links {result['link_bytes']}")
    if rate is not None:
        across = args.ranks // per
        print(f"modelled all-reduce across {across} namespaces "
              f"({per} concurrent, sharing each link) "
              f"{two_level_allreduce_s(numel * 4, across, per, rate) * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
