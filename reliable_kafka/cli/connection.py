"""Where the CLI's clients connect: the one place that turns `--config`, `-X`, RELIABLE_KAFKA_CONFIG and
`--bootstrap-servers` into librdkafka connection settings. Secret values never reach stdout, stderr or logs.

Only connection settings are taken (reliable_kafka.config.connection_settings decides which): the tools
pick their own safe producer and consumer settings, and a tuning key here would silently change what
they measure or audit.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import click

from reliable_kafka.cli.cluster import default_state_file
from reliable_kafka.cli.output import fail
from reliable_kafka.config import connection_settings
from reliable_kafka.testing.cluster import LocalKafkaCluster

log = logging.getLogger(__name__)

# The properties file used when --config is not given (as KAFKA_OPTS / a client.properties path is).
CONFIG_ENV = "RELIABLE_KAFKA_CONFIG"

# Keys whose value is a secret whatever their name says; any key naming a password or secret is one too.
_SECRET_KEYS = frozenset({"sasl.password", "ssl.key.password", "ssl.key.pem", "sasl.oauthbearer.client.secret"})

# Connection keys a file or -X cannot give, each with what to give instead.
_NOT_FROM_TEXT = {
    "oauth_cb": "is a Python callable, which a file or -X cannot carry; use sasl.oauthbearer.method=oidc "
                "and its sasl.oauthbearer.* settings",
    "sasl.jaas.config": "is the Java client's login setting; librdkafka takes sasl.username and "
                        "sasl.password (PLAIN, SCRAM) or the sasl.kerberos.* / sasl.oauthbearer.* settings",
}

F = TypeVar("F", bound=Callable[..., Any])


class _InputError(ValueError):
    """The connection input cannot be used; the message names the file, argument or key, never a secret."""


def is_secret(key: str) -> bool:
    lowered = key.lower()
    return lowered in _SECRET_KEYS or "password" in lowered or "secret" in lowered


def masked(config: Mapping[str, Any]) -> dict[str, Any]:
    """`config` fit to show: every secret value replaced by ***."""
    return {k: "***" if is_secret(k) else v for k, v in config.items()}


def redact(text: str, config: Mapping[str, Any] | None) -> str:
    """`text` (an error from a client, say) with every secret value of `config` in it replaced by ***."""
    for key, value in (config or {}).items():
        if is_secret(key) and isinstance(value, str) and value:
            text = text.replace(value, "***")
    return text


class _HideSecrets(logging.Filter):
    """Masks the secret values of one config in the records of the logger it is attached to."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        self._config = dict(config)

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        shown = redact(text, self._config)
        if shown != text:
            record.msg, record.args = shown, None
        return True


def hide_secrets_in_client_logs(config: Mapping[str, Any]) -> None:
    """librdkafka's own log lines (reliable_kafka.rdkafka) may quote a setting's value (CONFWARN does):
    this process's lines never show one of `config`'s secrets."""
    if any(is_secret(k) for k in config):
        logging.getLogger("reliable_kafka.rdkafka").addFilter(_HideSecrets(config))


def parse_properties(text: str, source: str) -> dict[str, str]:
    """`key=value` / `key: value` / `key value` lines of a Java-style properties file.

    Blank lines and lines starting with # or ! are skipped; whitespace around the key and the value is
    dropped (trailing blanks after a password are a typing accident far more often than a password).
    Line continuations and escapes are not supported: a line ending in a backslash is refused rather than
    read wrong.
    """
    props: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line[0] in "#!":
            continue
        if line.endswith("\\"):
            raise _InputError(f"{source} line {number}: continued lines (ending in \\) are not "
                                       "supported; put the setting on one line")
        # The key ends at the first '=', ':' or blank; one '=' or ':' (with blanks around it) may follow.
        end = next((i for i, c in enumerate(line) if c in "=:" or c.isspace()), len(line))
        key, rest = line[:end], line[end:].lstrip()
        if rest[:1] in ("=", ":"):
            rest = rest[1:]
        if not key:
            raise _InputError(f"{source} line {number}: no key before the separator")
        props[key] = rest.strip()
    return props


def read_properties(path: Path, label: str | None = None) -> dict[str, str]:
    """The settings of a properties file; errors name it as `label` (default: its path)."""
    label = label or str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise _InputError(f"connection config file {label} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise _InputError(f"cannot read connection config file {label}: {reason}") from None
    return parse_properties(text, label)


def _shown_arg(arg: str) -> str:
    """A malformed -X argument fit to show: whatever follows a ':' or a blank may be a value, so it is masked."""
    cut = next((i for i, c in enumerate(arg) if c == ":" or c.isspace()), None)
    return arg if cut is None else arg[:cut + 1] + "***"


def parse_overrides(args: Sequence[str]) -> dict[str, str]:
    """-X key=value arguments, later ones winning (as kcat reads them)."""
    out: dict[str, str] = {}
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep or not key.strip():
            raise _InputError(f"-X expects key=value, got {_shown_arg(arg)!r}")
        out[key.strip()] = value.strip()
    return out


def _canonical(layer: Mapping[str, str]) -> dict[str, str]:
    # metadata.broker.list is the old name of bootstrap.servers: one name, so a later layer overrides it.
    return {("bootstrap.servers" if k == "metadata.broker.list" else k): v for k, v in layer.items()}


def _check_keys(layer: Mapping[str, str], source: str) -> None:
    for key in layer:
        if key in _NOT_FROM_TEXT:
            raise _InputError(f"{source}: {key} {_NOT_FROM_TEXT[key]}")
    refused = sorted(set(layer) - set(connection_settings(layer)))
    if refused:
        what = "is not a connection setting" if len(refused) == 1 else "are not connection settings"
        raise _InputError(
            f"{source}: {', '.join(refused)} {what}; "
            "the command picks its own safe producer and consumer settings, so only where and how to connect "
            "is taken (bootstrap.servers, security.protocol, sasl.*, ssl.*, socket.*, client.*, ...)")


def merge(file_props: Mapping[str, str], file_source: str, overrides: Sequence[str],
          bootstrap_servers: str | None) -> dict[str, str]:
    """The file's settings, then -X over them, then --bootstrap-servers over both; keys checked per source."""
    file_layer = _canonical(file_props)
    _check_keys(file_layer, file_source)
    x_layer = _canonical(parse_overrides(overrides))
    _check_keys(x_layer, "-X")
    merged = {**file_layer, **x_layer}
    if bootstrap_servers is not None:
        merged["bootstrap.servers"] = bootstrap_servers
    return merged


def resolve(bootstrap_servers: str | None, config_file: Path | None, overrides: Sequence[str],
            environ: Mapping[str, str] | None = None) -> dict[str, str] | None:
    """The merged connection settings, or None when nothing was given (the command's own default applies).

    The file is --config, else the one RELIABLE_KAFKA_CONFIG names in `environ` (default: os.environ;
    empty: no fallback). Raises _InputError.
    """
    env = os.environ if environ is None else environ
    source = config_file
    if source is None and env.get(CONFIG_ENV, "").strip():
        source = Path(env[CONFIG_ENV].strip())
    if source is None and not overrides and bootstrap_servers is None:
        return None
    label = str(source) if config_file is not None else f"{source} (from {CONFIG_ENV})"
    file_props = read_properties(source, label) if source is not None else {}
    merged = merge(file_props, label, overrides, bootstrap_servers)
    log.info("connection settings: %s", masked(merged))
    return merged


def connection_config(bootstrap_servers: str | None, config_file: Path | None, overrides: Sequence[str], *,
                      code: int = 1, use_env: bool = True) -> dict[str, str] | None:
    """resolve() for a command: bad input ends it with a message naming the file, argument or key (exit
    `code`). `use_env=False`: RELIABLE_KAFKA_CONFIG is not read (for a command that never connects to
    the user's own cluster)."""
    try:
        conf = resolve(bootstrap_servers, config_file, overrides, None if use_env else {})
        if conf is not None:
            hide_secrets_in_client_logs(conf)
        return conf
    except _InputError as exc:
        fail(str(exc), code=code)
    raise AssertionError("unreachable")


def connection_options(bootstrap_help: str, *, env_default: bool = True) -> Callable[[F], F]:
    """Add --bootstrap-servers, --config and -X to a command (its parameters: bootstrap_servers,
    config_file, overrides; pass them to connection_config(), with use_env=env_default)."""
    default = f"default: the file ${CONFIG_ENV} names." if env_default else f"${CONFIG_ENV} is not read here."

    def decorate(command: F) -> F:
        command = click.option(
            "-X", "overrides", multiple=True, metavar="KEY=VALUE",
            help="A librdkafka connection setting (repeatable); overrides --config.")(command)
        command = click.option(
            "--config", "config_file", type=click.Path(dir_okay=False, path_type=Path), default=None,
            metavar="FILE",
            help=f"Connection settings from a properties file (key=value lines, as client.properties); "
                 f"{default}")(command)
        return click.option("--bootstrap-servers", default=None, help=bootstrap_help)(command)

    return decorate


def running_cluster(state_file: Path | None = None) -> LocalKafkaCluster | None:
    """The cluster `reliable-kafka cluster start` runs, if one is up (its state file names live pids)."""
    state = state_file or default_state_file()
    if not state.exists():
        return None
    try:
        cluster = LocalKafkaCluster.attach(state)
    except (OSError, ValueError, KeyError) as exc:
        log.warning("ignoring unreadable cluster state %s: %s", state, exc)
        return None
    return cluster if any(n.alive() for n in cluster.nodes.values()) else None
