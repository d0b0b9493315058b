"""The CLI's connection settings: a properties file, -X over it, --bootstrap-servers over both,
RELIABLE_KAFKA_CONFIG only without --config; only connection keys; secrets never shown."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner

from reliable_kafka.cli.connection import (
    CONFIG_ENV,
    hide_secrets_in_client_logs,
    masked,
    parse_overrides,
    parse_properties,
    redact,
    resolve,
)
from reliable_kafka.cli.main import cli

SENTINEL = "sentinel-" + uuid.uuid4().hex


def test_properties_lines_comments_separators_and_whitespace() -> None:
    text = "\n".join([
        "# a comment",
        "! also a comment",
        "",
        "   ",
        "bootstrap.servers=b1:9092,b2:9092",
        "security.protocol : SASL_SSL",
        "  sasl.mechanism=SCRAM-SHA-512   ",
        "sasl.username   alice",
        "sasl.password=a=b:c#not-a-comment",
        "ssl.ca.location =",
    ])
    assert parse_properties(text, "f") == {
        "bootstrap.servers": "b1:9092,b2:9092", "security.protocol": "SASL_SSL",
        "sasl.mechanism": "SCRAM-SHA-512", "sasl.username": "alice", "sasl.password": "a=b:c#not-a-comment",
        "ssl.ca.location": ""}


def test_a_continued_line_is_refused_not_misread() -> None:
    with pytest.raises(ValueError, match=r"f line 2: continued lines"):
        parse_properties("a=b\nsasl.username=x \\\n  y", "f")


def _props(tmp_path: Path, name: str, **settings: str) -> Path:
    path = tmp_path / name
    path.write_text("".join(f"{k.replace('_', '.')}={v}\n" for k, v in settings.items()))
    return path


def test_precedence_file_then_x_then_bootstrap_servers(tmp_path: Path) -> None:
    f = _props(tmp_path, "c.properties", bootstrap_servers="file:1", client_id="from-file", sasl_username="u")
    env = _props(tmp_path, "env.properties", bootstrap_servers="env:1", sasl_mechanism="PLAIN")
    environ = {CONFIG_ENV: str(env)}
    # --config wins over the environment's file entirely (not merged with it)
    assert resolve(None, f, (), environ) == {"bootstrap.servers": "file:1", "client.id": "from-file",
                                             "sasl.username": "u"}
    # without --config, the environment's file is the base
    assert resolve(None, None, ("client.id=x",), environ) == {"bootstrap.servers": "env:1",
                                                              "sasl.mechanism": "PLAIN", "client.id": "x"}
    # -X over the file, later -X over earlier, --bootstrap-servers over both
    assert resolve(None, f, ("client.id=x1", "client.id=x2", "bootstrap.servers=x:1"), {}) == {
        "bootstrap.servers": "x:1", "client.id": "x2", "sasl.username": "u"}
    assert resolve("flag:1", f, ("bootstrap.servers=x:1",), {})["bootstrap.servers"] == "flag:1"  # type: ignore[index]
    # the old name of bootstrap.servers is the same setting: a later layer overrides it
    assert resolve(None, None, ("metadata.broker.list=old:1", "bootstrap.servers=new:1"), {}) == {
        "bootstrap.servers": "new:1"}


def test_nothing_given_is_none_so_the_command_keeps_its_default() -> None:
    assert resolve(None, None, (), {}) is None
    assert resolve(None, None, (), {CONFIG_ENV: "  "}) is None
    assert resolve("b:1", None, (), {}) == {"bootstrap.servers": "b:1"}


@pytest.mark.parametrize("key", ["acks", "group.id", "enable.idempotence", "linger.ms"])
def test_a_non_connection_key_is_refused_by_name(tmp_path: Path, key: str) -> None:
    f = tmp_path / "c.properties"
    f.write_text(f"bootstrap.servers=b:1\n{key}=1\n")
    with pytest.raises(ValueError, match=rf"{f}: {key} is not a connection setting; .*safe producer"):
        resolve(None, f, (), {})
    with pytest.raises(ValueError, match=rf"-X: {key} is not a connection setting"):
        resolve(None, None, (f"{key}=1",), {})


def test_settings_that_cannot_come_from_text_say_what_to_use_instead() -> None:
    with pytest.raises(ValueError, match="sasl.jaas.config is the Java client's .* sasl.username"):
        resolve(None, None, ("sasl.jaas.config=x",), {})
    with pytest.raises(ValueError, match="oauth_cb is a Python callable"):
        resolve(None, None, ("oauth_cb=x",), {})


def test_malformed_x_and_missing_file_are_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="-X expects key=value, got 'client.id'"):
        parse_overrides(["client.id"])
    with pytest.raises(ValueError, match="-X expects key=value"):
        parse_overrides(["=value"])
    missing = tmp_path / "nope.properties"
    with pytest.raises(ValueError, match=f"connection config file {missing} does not exist"):
        resolve(None, missing, (), {})
    with pytest.raises(ValueError, match=rf"{missing} \(from {CONFIG_ENV}\) does not exist"):
        resolve(None, None, (), {CONFIG_ENV: str(missing)})
    with pytest.raises(ValueError, match="cannot read connection config file"):
        resolve(None, tmp_path, (), {})  # a directory


def test_a_malformed_x_never_shows_what_may_be_its_value() -> None:
    with pytest.raises(ValueError) as caught:
        parse_overrides([f"sasl.password:{SENTINEL}"])
    assert SENTINEL not in str(caught.value) and "sasl.password:***" in str(caught.value)


def test_masked_and_redact_hide_every_kind_of_secret() -> None:
    conf = {"sasl.password": "p1", "ssl.key.password": "p2", "ssl.key.pem": "pem3",
            "sasl.oauthbearer.client.secret": "s4", "ssl.keystore.password": "p5", "my.secret.thing": "s6",
            "sasl.username": "alice"}
    assert masked(conf) == {**dict.fromkeys(list(conf)[:-1], "***"), "sasl.username": "alice"}
    assert redact("login p1 pem3 s4 p5 s6 as alice failed", conf) == "login *** *** *** *** *** as alice failed"


def test_client_log_lines_never_show_a_secret(caplog: pytest.LogCaptureFixture) -> None:
    hide_secrets_in_client_logs({"sasl.password": SENTINEL})
    with caplog.at_level(logging.WARNING, logger="reliable_kafka.rdkafka"):
        logging.getLogger("reliable_kafka.rdkafka").warning("CONFWARN: `sasl.password` set to `%s`", SENTINEL)
    assert SENTINEL not in caplog.text and "set to `***`" in caplog.text


# ---- through the commands -----------------------------------------------------------------------


def _invoke(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["-vv", *args], env=env)
    return result.exit_code, result.output  # stdout and stderr, as a terminal shows them


def _assert_never_shown(out: str, caplog: pytest.LogCaptureFixture) -> None:
    assert SENTINEL not in out
    assert SENTINEL not in caplog.text
    assert all(SENTINEL not in str(r.args) for r in caplog.records)


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    return _props(tmp_path, "client.properties", bootstrap_servers="127.0.0.1:1", security_protocol="SASL_SSL",
                  sasl_mechanism="SCRAM-SHA-512", sasl_username="alice", sasl_password=SENTINEL)


@pytest.mark.parametrize("command", [["doctor"], ["bench", "producer"], ["lab", "acks1-leader-loss"]])
def test_a_refused_key_fails_every_command_clearly_without_the_password(
    command: list[str], secret_file: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    code, out = _invoke(*command, "--config", str(secret_file), "-X", "acks=1", "-X", f"ssl.key.password={SENTINEL}")
    assert code in (1, 2) and "-X: acks is not a connection setting" in out, out
    _assert_never_shown(out, caplog)


def test_malformed_x_and_a_missing_file_fail_doctor_clearly(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    code, out = _invoke("doctor", "-X", f"sasl.password {SENTINEL}")
    assert code == 1 and "-X expects key=value, got 'sasl.password ***'" in out
    _assert_never_shown(out, caplog)
    code, out = _invoke("doctor", env={CONFIG_ENV: str(tmp_path / "gone.properties")})
    assert code == 1 and "gone.properties (from RELIABLE_KAFKA_CONFIG) does not exist" in out.replace("\n", "")


@pytest.mark.waits  # doctor's 10 s of librdkafka timeouts against no broker
def test_doctor_on_unreachable_brokers_with_a_login_never_prints_the_password(
    secret_file: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    code, out = _invoke("doctor", "--json", "--config", str(secret_file), "-X", "socket.timeout.ms=1000",
                        "-X", "security.protocol=SASL_PLAINTEXT")
    assert code == 1 and "cannot audit 127.0.0.1:1" in out
    assert "***" in caplog.text  # -vv logs the settings in use, the password masked
    _assert_never_shown(out, caplog)


def _secured_state(tmp_path: Path) -> Path:
    """The state `cluster start --security sasl-scram+tls` leaves (one node on 127.0.0.1:1, not running)."""
    from reliable_kafka.testing.cluster import KafkaNode, LocalKafkaCluster

    cluster = LocalKafkaCluster(brokers=1, security="sasl-scram+tls", data_dir=tmp_path / "data")
    cluster.nodes[1] = KafkaNode(1, 1, 2, tmp_path / "data" / "node-1")
    cluster.save_state(tmp_path / "cluster.json")
    return tmp_path / "cluster.json"


def test_the_lab_refuses_a_login_other_than_the_clusters_own_and_ignores_the_environment(
    secret_file: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    state = _secured_state(tmp_path)
    # Another user's login would be used by no client: refused, naming the keys, before any broker is asked.
    code, out = _invoke("lab", "acks1-leader-loss", "--state-file", str(state), "--config", str(secret_file))
    flat = out.replace("\n", " ")
    assert code == 2 and "sasl.password, sasl.username differ" in flat, out
    _assert_never_shown(out, caplog)
    # RELIABLE_KAFKA_CONFIG names the user's own cluster: the lab does not read it (and so does not refuse it)
    code, out = _invoke("lab", "acks1-leader-loss", "--bootstrap-servers", "127.0.0.1:1",
                        "--state-file", str(tmp_path / "none.json"), env={CONFIG_ENV: str(secret_file)})
    assert code == 4 and "reliable-kafka cluster start" in out


def test_the_lab_accepts_the_clusters_own_settings_file_and_nothing_else(tmp_path: Path) -> None:
    from reliable_kafka.cli.connection import read_properties
    from reliable_kafka.cli.lab import unused_settings
    from reliable_kafka.testing.cluster import LocalKafkaCluster

    state = _secured_state(tmp_path)
    cluster = LocalKafkaCluster.attach(state)
    own = read_properties(LocalKafkaCluster.client_properties_path(state))
    assert unused_settings(own, cluster) == []
    assert unused_settings({**own, "client.id": "x"}, cluster) == ["client.id"]
    # The cluster the lab starts itself is open: a login for it is refused too.
    assert unused_settings({"security.protocol": "SASL_SSL"}, LocalKafkaCluster()) == ["security.protocol"]


def test_bench_workers_get_the_settings_in_their_environment_not_their_command_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import subprocess

    from reliable_kafka.bench import common
    from reliable_kafka.testing import child_connection

    seen: dict[str, object] = {}

    def fake_run(argv: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
        seen["argv"], seen["env"] = argv, kw["env"]
        return subprocess.CompletedProcess(argv, 0, '{"msgs_per_s": 1.0, "peak_rss_mb": 1.0}\n', "")

    monkeypatch.setattr(common.subprocess, "run", fake_run)
    conn = {"bootstrap.servers": "b:1", "sasl.password": SENTINEL}
    common.run_variant("producer", "raw", ["--topic", "t", "--messages", "1"], conn)
    assert SENTINEL not in " ".join(seen["argv"])  # type: ignore[arg-type]
    monkeypatch.setenv(child_connection.CONNECTION_ENV, seen["env"][child_connection.CONNECTION_ENV])  # type: ignore[index]
    assert child_connection.connection_from_env() == conn


def test_the_java_clients_of_spark_get_the_same_login_translated_and_the_rest_refused_by_name() -> None:
    from reliable_kafka.errors import ConfigError
    from reliable_kafka.spark.java_options import java_kafka_options

    assert java_kafka_options({"bootstrap.servers": "b:1"}) == {"kafka.bootstrap.servers": "b:1"}
    scram = java_kafka_options({"bootstrap.servers": "b:1", "security.protocol": "sasl_ssl",
                                "sasl.mechanism": "SCRAM-SHA-512", "sasl.username": "alice",
                                "sasl.password": 'se"cr\\et', "ssl.ca.location": "/ca.pem"})
    assert scram == {
        "kafka.bootstrap.servers": "b:1", "kafka.security.protocol": "SASL_SSL",
        "kafka.sasl.mechanism": "SCRAM-SHA-512",
        "kafka.sasl.jaas.config": 'org.apache.kafka.common.security.scram.ScramLoginModule required '
                                  'username="alice" password="se\\"cr\\\\et";',
        "kafka.ssl.truststore.type": "PEM", "kafka.ssl.truststore.location": "/ca.pem",
    }
    assert "PlainLoginModule" in java_kafka_options({"sasl.mechanisms": "PLAIN", "sasl.username": "u",
                                                     "sasl.password": "p"})["kafka.sasl.jaas.config"]
    for refused, key in (({"sasl.mechanism": "OAUTHBEARER", "sasl.password": SENTINEL}, "sasl.mechanism"),
                         ({"ssl.key.location": "/k.pem", "sasl.password": SENTINEL}, "sasl.mechanism"),
                         ({"ssl.certificate.location": "/c.pem"}, "ssl.certificate.location")):
        with pytest.raises(ConfigError) as caught:
            java_kafka_options({"bootstrap.servers": "b:1", **refused})
        assert caught.value.key == key and SENTINEL not in str(caught.value)
