"""bench/delayed_link.py's relay (bench/link_relay.c) between namespaced hosts: it adds
the delay asked for each way, and its own latency is small and measured. Needs root and
network namespaces (tests/support/netns_hosts.py), like the remote-mode tests; about 10 s.
What the delayed link does to a cluster's steps is a benchmark (bench/step_time.py
--netns; docs/BENCHMARKS.md)."""

from __future__ import annotations

import shutil

import pytest

from tests.support import netns_hosts

pytestmark = [pytest.mark.cluster]


def _skip_without_a_relay() -> None:
    reason = netns_hosts.unavailable() or (
        None if shutil.which("cc") or shutil.which("gcc") else "no C compiler (apt-get install gcc)"
    )
    if reason:
        pytest.skip(f"the delayed link needs namespaced hosts and a C compiler: {reason}")


def test_the_relay_adds_its_delay_each_way_and_little_of_its_own() -> None:
    _skip_without_a_relay()
    from bench.delayed_link import DelayedLinks, round_trip_us

    hosts = netns_hosts.NetnsHosts(count=1).up()
    try:
        with DelayedLinks(hosts, delay_us=300) as links:
            report = links.report
            delayed = round_trip_us(hosts.workers[0], trips=100)
        after = round_trip_us(hosts.workers[0], trips=100)  # the bridge again, undone
    finally:
        hosts.down()
    assert report["own_us"] < 100, report  # a wake-up and two copies, not a Python loop
    assert report["set_us"] == pytest.approx(300 - report["own_us"], abs=0.2)
    # 300 us each way, on top of the plain bridge's round trip
    assert delayed > report["round_trip_direct_us"] + 2 * 300 * 0.9, report
    assert after < delayed - 400, (after, delayed)


def test_a_ring_all_sums_traffic_crosses_the_relays_between_workers_too() -> None:
    """bench/relay_ring.py at 3 ranks: frames between the two workers pass both relays
    (their queue for frames from other workers), so each of a round's 4 steps crosses at
    least one delay, and the round takes longer than the 4 delays on top of the bridge's."""
    _skip_without_a_relay()
    from bench.delayed_link import DelayedLinks
    from bench.relay_ring import GATEWAY, ring

    hosts = netns_hosts.NetnsHosts(count=2).up()
    try:
        addresses = [GATEWAY] + [w.address for w in hosts.workers]
        bridge = ring(hosts, addresses, rounds=60, nbytes=4096)
        with DelayedLinks(hosts, delay_us=300):
            relayed = ring(hosts, addresses, rounds=60, nbytes=4096)
    finally:
        hosts.down()
    assert relayed["median_ms"] > bridge["median_ms"] + 4 * 0.3 * 0.9, (bridge, relayed)
