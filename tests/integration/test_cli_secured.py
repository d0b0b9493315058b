"""`reliable-kafka doctor` against a real SASL/PLAIN cluster, logged in through --config or -X, and refused
with a wrong password: it reports, and the password is printed nowhere. And `cluster start --security`:
a SCRAM-over-TLS cluster that doctor audits as its super user.

bench is not run here: its topics need three replicas and the producer's preflight refuses fewer, so it
cannot run on this one-node cluster; tests/unit/test_cli_connection.py shows its workers get the settings.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from reliable_kafka.cli.main import cli
from reliable_kafka.testing import LocalKafkaCluster
from reliable_kafka.testing.cluster import QUICK_START_JVM_OPTIONS
from tests.fixtures.kafka import _require_kafka

pytestmark = pytest.mark.cluster

CAROL = "carol-" + uuid.uuid4().hex[:6]
PASSWORD = "sentinel-" + uuid.uuid4().hex


@pytest.fixture(scope="module")
def secured() -> Iterator[LocalKafkaCluster]:
    """One node: the login happens on every broker alike."""
    _require_kafka()
    with LocalKafkaCluster(brokers=1, jvm_options=QUICK_START_JVM_OPTIONS, security="sasl-plain",
                           users={CAROL: PASSWORD}) as cluster:
        cluster.wait_healthy()
        yield cluster


def _doctor(*args: str, verbose: bool = False) -> tuple[int, str, str]:
    # -vv: the settings in use and librdkafka's lines are logged too, where a password must not show either
    result = CliRunner().invoke(cli, [*(["-vv"] if verbose else []), "doctor", "--json", *args])
    return result.exit_code, result.stdout, result.stderr


def _properties(path: Path, conf: dict[str, object]) -> Path:
    path.write_text("# written from the test cluster's client_config()\n"
                    + "".join(f"{k} = {v}\n" for k, v in conf.items()))
    return path


def _assert_reports(code: int, stdout: str, stderr: str) -> None:
    assert code in (0, 2), stdout + stderr  # 2: critical findings (one node: replication factor 1)
    findings = json.loads(stdout)["findings"]
    assert findings and {f["check"] for f in findings}, findings
    assert PASSWORD not in stdout and PASSWORD not in stderr


def test_doctor_logs_in_from_a_properties_file(secured: LocalKafkaCluster, tmp_path: Path) -> None:
    config = _properties(tmp_path / "client.properties", secured.client_config(CAROL))
    _assert_reports(*_doctor("--config", str(config)))


def test_doctor_logs_in_from_x_settings(secured: LocalKafkaCluster) -> None:
    args = [a for k, v in secured.client_config(CAROL).items() for a in ("-X", f"{k}={v}")]
    _assert_reports(*_doctor(*args))


def test_doctor_with_a_wrong_password_fails_clearly_and_never_prints_it(
    secured: LocalKafkaCluster, tmp_path: Path,
) -> None:
    wrong = "sentinel-wrong-" + uuid.uuid4().hex
    config = _properties(tmp_path / "client.properties", {**secured.client_config(CAROL), "sasl.password": wrong})
    code, stdout, stderr = _doctor("--config", str(config), verbose=True)
    assert code == 1, stdout + stderr
    assert f"cannot audit {secured.bootstrap_servers}: the brokers refused to authenticate" in stderr
    assert "check sasl.username and sasl.password" in stderr
    for secret in (wrong, PASSWORD):
        assert secret not in stdout and secret not in stderr


def test_a_secured_cluster_started_by_the_cli_is_audited_as_its_super_user_without_showing_a_secret(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`cluster start --security sasl-scram+tls`: SCRAM over TLS; the super user's settings go to a file
    only its owner reads, which `doctor` uses by itself (and through --config); `cluster stop` removes it."""
    _require_kafka()
    state = tmp_path / "cluster.json"
    monkeypatch.setenv("RK_CLUSTER_STATE", str(state))
    runner = CliRunner()
    started = runner.invoke(cli, ["cluster", "start", "--brokers", "1", "--security", "sasl-scram+tls", "--json"])
    properties = LocalKafkaCluster.client_properties_path(state)
    try:
        assert started.exit_code == 0, started.stdout + started.stderr
        assert json.loads(started.stdout)["client_properties"] == str(properties)
        assert properties.stat().st_mode & 0o777 == 0o600
        settings = dict(line.split("=", 1) for line in properties.read_text().splitlines())
        assert settings["security.protocol"] == "SASL_SSL" and settings["sasl.mechanism"] == "SCRAM-SHA-512"
        secret = settings["sasl.password"]
        for code, stdout, stderr in (_doctor(), _doctor("--config", str(properties))):
            _assert_reports(code, stdout, stderr)
            assert secret not in stdout + stderr
        assert secret not in started.stdout + started.stderr + state.read_text()
    finally:
        stopped = runner.invoke(cli, ["cluster", "stop"])
    assert stopped.exit_code == 0, stopped.stdout + stopped.stderr
    assert not properties.exists() and not state.exists()
