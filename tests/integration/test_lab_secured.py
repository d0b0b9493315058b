"""The loss lab on a secured cluster (SASL/SCRAM-SHA-512 over TLS, no access without an ACL): the scenario's
clients and the producer programs it SIGKILLs log in with the cluster's settings, and the verdict holds
there as on the open cluster: reliable_kafka loses and duplicates nothing, the bare control loses."""

from __future__ import annotations

import pytest

from reliable_kafka.lab.base import CONTROL, RELIABLE, no_progress
from reliable_kafka.lab.producer_scenarios import producer_crash
from reliable_kafka.testing import LocalKafkaCluster
from reliable_kafka.testing.cluster import QUICK_START_JVM_OPTIONS
from tests.fixtures.kafka import _require_kafka

pytestmark = pytest.mark.cluster


def test_producer_crash_on_a_sasl_scram_tls_cluster_loses_nothing_and_the_control_does(
    request: pytest.FixtureRequest,
) -> None:
    _require_kafka()
    # One node: what a SIGKILL loses is the client's buffer, whatever the replication (the lab runs 3 nodes).
    with LocalKafkaCluster(brokers=1, jvm_options=QUICK_START_JVM_OPTIONS, security="sasl-scram+tls") as cluster:
        request.node.rk_cluster = cluster  # broker logs attached to a failure report
        cluster.wait_healthy()
        # Smaller than the lab's run (5 kills of 30,000): each kill still catches accepted, undelivered messages.
        results = {r.client: r for r in producer_crash(cluster, no_progress, kills=2, messages=8_000,
                                                       between=(500, 1_500))}
    ours, control = results[RELIABLE], results[CONTROL]
    assert ours.acked > 0 and ours.lost == 0 and ours.duplicates_after_dedup == 0, ours
    # The control bites: its process died with acknowledged-as-accepted messages in its buffer.
    assert control.acked > 0 and control.lost > 0, control
