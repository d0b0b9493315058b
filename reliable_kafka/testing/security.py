"""How a secured LocalKafkaCluster is set up: its listener's protocol, the brokers' SASL and TLS settings,
the credentials formatted into the metadata, and the settings a client needs to log in.

Real authentication and authorization, nothing faked: SASL/PLAIN or SASL/SCRAM-SHA-512 logins, TLS with
a certificate made for the run, Kafka's StandardAuthorizer with no access without an ACL. The harness is
the super user "admin"; secrets stay out of repr() and of the cluster's description.
"""

from __future__ import annotations

import secrets
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reliable_kafka.errors import ClusterError

# None: an open PLAINTEXT cluster. "tls": encrypted, no login and no ACLs. The others log in with SASL
# (PLAIN: passwords in the brokers' JAAS settings, fixed at start; SCRAM-SHA-512: salted credentials in
# the metadata, created at format time and added while it runs, as production clusters do) and are
# authorized by ACLs; "+tls" runs them over TLS (SASL_SSL).
MODES = (None, "tls", "sasl-plain", "sasl-scram", "sasl-plain+tls", "sasl-scram+tls")
_MECHANISM = {"sasl-plain": "PLAIN", "sasl-scram": "SCRAM-SHA-512"}


@dataclass
class ClusterSecurity:
    mode: str | None = None
    admin_password: str = field(default_factory=lambda: secrets.token_urlsafe(18), repr=False)
    # The run's certificate (set by prepare(), or restore()): the brokers' keystore and the PEM clients trust.
    _keystore: Path | None = field(default=None, init=False, repr=False)
    _ca: Path | None = field(default=None, init=False, repr=False)
    _keystore_password: str = field(default_factory=lambda: secrets.token_urlsafe(18), init=False, repr=False)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"security={self.mode!r} is not supported: use one of {', '.join(map(repr, MODES))}")

    @property
    def mechanism(self) -> str | None:
        """The SASL mechanism, or None when clients do not log in."""
        return _MECHANISM.get((self.mode or "").removesuffix("+tls"))

    @property
    def tls(self) -> bool:
        return self.mode is not None and self.mode.endswith("tls")

    @property
    def protocol(self) -> str:
        """The client listener's security.protocol."""
        return {(False, False): "PLAINTEXT", (True, False): "SASL_PLAINTEXT", (False, True): "SSL",
                (True, True): "SASL_SSL"}[(self.mechanism is not None, self.tls)]

    @property
    def ca_location(self) -> Path | None:
        """The PEM certificate a client trusts to verify the brokers (TLS modes, after prepare())."""
        return self._ca

    @classmethod
    def restore(cls, mode: str | None, admin: dict[str, str]) -> ClusterSecurity:
        """The security of a running cluster, from the admin client settings its state keeps (see
        LocalKafkaCluster.save_state): enough to log in, not to restart it with new settings."""
        restored = cls(mode, admin_password=admin.get("sasl.password", ""))
        if admin.get("ssl.ca.location"):
            restored._ca = Path(admin["ssl.ca.location"])
        return restored

    def prepare(self, directory: Path, java: str) -> None:
        """Make what the brokers need before they start: for TLS, a CA and a certificate it signed.

        A CA made for the run signs one certificate for 127.0.0.1 that serves every node (they all listen
        there); clients and the brokers replicating to each other trust the CA, so the whole chain is
        verified as in production. The JDK's keytool makes them: nothing beyond the JDK the brokers need.
        """
        if not self.tls or self._keystore is not None:
            return
        directory.mkdir(parents=True, exist_ok=True)
        keystore, ca_store = directory / "broker.p12", directory / "ca.p12"
        ca_pem, csr, signed = directory / "ca.pem", directory / "broker.csr", directory / "broker.pem"
        keytool = str(Path(java).with_name("keytool"))

        def store(path: Path) -> list[str]:
            return ["-keystore", str(path), "-storetype", "PKCS12", "-storepass", self._keystore_password]

        key = ["-keyalg", "RSA", "-keysize", "2048", "-validity", "30"]
        for args in (
            ["-genkeypair", "-alias", "ca", *key, "-dname", "CN=reliable-kafka test CA", "-ext", "bc:c",
             *store(ca_store)],
            ["-exportcert", "-rfc", "-alias", "ca", "-file", str(ca_pem), *store(ca_store)],
            ["-genkeypair", "-alias", "broker", *key, "-dname", "CN=localhost", *store(keystore)],
            ["-certreq", "-alias", "broker", "-file", str(csr), *store(keystore)],
            ["-gencert", "-rfc", "-alias", "ca", "-infile", str(csr), "-outfile", str(signed), "-validity", "30",
             "-ext", "SAN=ip:127.0.0.1,dns:localhost", "-ext", "eku=serverAuth,clientAuth", *store(ca_store)],
            # The broker's keystore holds the whole chain: the CA first, then its signed certificate.
            ["-importcert", "-noprompt", "-alias", "ca", "-file", str(ca_pem), *store(keystore)],
            ["-importcert", "-alias", "broker", "-file", str(signed), *store(keystore)],
        ):
            done = subprocess.run([keytool, *args], capture_output=True, text=True, timeout=120, check=False)
            if done.returncode != 0:
                said = (done.stdout + done.stderr).replace(self._keystore_password, "***")
                raise ClusterError(f"keytool could not make the cluster's TLS certificates ({args[0]}): {said}")
        self._keystore, self._ca = keystore, ca_pem

    def broker_settings(self, users: dict[str, str]) -> dict[str, Any]:
        """server.properties entries for the client listener (named after its protocol)."""
        if self.mode is None:
            return {}
        settings: dict[str, Any] = {}
        listener = self.protocol.lower()
        if self.tls:
            if self._keystore is None:
                raise ClusterError("the TLS certificate was not made: call prepare() before writing the settings")
            settings.update({
                "ssl.keystore.type": "PKCS12",
                "ssl.keystore.location": str(self._keystore),
                "ssl.keystore.password": self._keystore_password,
                "ssl.key.password": self._keystore_password,
                # Brokers replicate over this listener too: they trust the same certificate clients do.
                "ssl.truststore.type": "PEM",
                "ssl.truststore.location": str(self.ca_location),
            })
        mechanism = self.mechanism
        if mechanism is None:
            return settings
        # Brokers replicate as "admin". The controller listener stays PLAINTEXT on loopback and is never
        # advertised: its principal (ANONYMOUS) is a super user so that the quorum's own traffic is authorized.
        login = f'username="admin" password="{self.admin_password}"'
        if mechanism == "PLAIN":
            accounts = {"admin": self.admin_password, **users}
            known = " ".join(f'user_{name}="{password}"' for name, password in accounts.items())
            jaas = f"org.apache.kafka.common.security.plain.PlainLoginModule required {login} {known};"
        else:  # SCRAM: every credential lives in the metadata (format_args)
            jaas = f"org.apache.kafka.common.security.scram.ScramLoginModule required {login};"
        return {
            **settings,
            "sasl.enabled.mechanisms": mechanism,
            "sasl.mechanism.inter.broker.protocol": mechanism,
            f"listener.name.{listener}.{mechanism.lower()}.sasl.jaas.config": jaas,
            "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
            "super.users": "User:admin;User:ANONYMOUS",
            "allow.everyone.if.no.acl.found": False,
        }

    def format_args(self, users: dict[str, str]) -> list[str]:
        """StorageTool arguments: SCRAM credentials must exist before any broker starts (they log in too)."""
        if self.mechanism != "SCRAM-SHA-512":
            return []
        args: list[str] = []
        for name, password in {"admin": self.admin_password, **users}.items():
            args += ["--add-scram", f"SCRAM-SHA-512=[name={name},password={password}]"]
        return args

    def secrets(self, users: dict[str, str]) -> list[str]:
        """Every secret of the cluster, for redacting tool output."""
        return [self.admin_password, self._keystore_password, *users.values()]

    def client_settings(self, user: str, users: dict[str, str]) -> dict[str, Any]:
        """librdkafka settings that log in as `user` ("admin": the harness's super user)."""
        settings: dict[str, Any] = {}
        if self.mode is None:
            return settings
        settings["security.protocol"] = self.protocol
        if self.tls:
            settings["ssl.ca.location"] = str(self.ca_location)
        if self.mechanism is not None:
            password = self.admin_password if user == "admin" else users.get(user)
            if password is None:
                raise ValueError(f"no user {user!r} on this cluster: pass users={{{user!r}: password}} when "
                                 "creating it")
            settings.update({"sasl.mechanism": self.mechanism, "sasl.username": user, "sasl.password": password})
        return settings
