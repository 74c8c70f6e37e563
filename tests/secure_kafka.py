"""Apache Kafka with its clients' listeners secured, for the tests of TLS and SASL/SCRAM.

``start_secure_kafka(root)`` makes a certificate authority and a certificate for
``localhost`` and ``127.0.0.1`` signed by it (PEM files under ``root``, with the
``cryptography`` library), and starts one Apache Kafka node with two client listeners:

- ``SASL_SSL`` (TLS, then SCRAM-SHA-512) on the node's client port: ``bootstrap``;
- ``SSL`` (TLS alone, no authentication) on another port: ``tls_bootstrap``.

Brokers talk to each other on the SASL_SSL listener as the SCRAM user ``broker``;
clients log in as ``USER``. Both users are created when the storage is formatted
(``start_apache(scram_users=)``), before the node starts. The controller listener stays
plaintext on loopback.

``python -m tests.secure_kafka DIR`` runs one until Ctrl-C or SIGTERM, for trying the
settings by hand (docs/kafka.md): the certificates go to DIR, and once it serves,
``DIR/sasl.env`` and ``DIR/tls.env`` hold the ``export`` lines of a client's settings
(``STEPSTREAM_KAFKA_BOOTSTRAP_SERVERS`` included) for each listener.
"""

from __future__ import annotations

import datetime
import ipaddress
import shlex
import signal
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from stepstream.ops.brokers.apache import ApacheCluster, start_apache
from stepstream.ops.brokers.apache_config import ScramUser

MECHANISM = "SCRAM-SHA-512"
USER = "stepstream"
PASSWORD = "app-secret-1"
BROKER_USER = ScramUser("broker", "broker-secret-1", MECHANISM)


@dataclass(frozen=True)
class Certificates:
    ca: Path  # the authority's certificate: what clients trust (ssl.ca.location)
    keystore: Path  # the broker's private key and certificate chain, PEM


def make_certificates(root: Path) -> Certificates:
    """A CA and a server certificate for localhost and 127.0.0.1, valid for two days."""
    root.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "stepstream test CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    ca_path, keystore = root / "ca.pem", root / "broker.pem"
    ca_path.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    # Kafka's PEM keystore: a PKCS#8 private key, then the certificate chain.
    keystore.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        + cert.public_bytes(serialization.Encoding.PEM)
        + ca_cert.public_bytes(serialization.Encoding.PEM)
    )
    return Certificates(ca_path, keystore)


@dataclass
class SecureKafka:
    cluster: ApacheCluster
    certificates: Certificates
    tls_bootstrap: str

    @property
    def bootstrap(self) -> str:
        """The SASL_SSL listener."""
        return self.cluster.bootstrap

    @property
    def ca(self) -> Path:
        return self.certificates.ca

    def sasl_env(self, password: str = PASSWORD) -> dict[str, str]:
        """The documented variables for the SASL_SSL listener (docs/kafka.md)."""
        return {
            "STEPSTREAM_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
            "STEPSTREAM_KAFKA_SASL_MECHANISM": MECHANISM,
            "STEPSTREAM_KAFKA_SASL_USERNAME": USER,
            "STEPSTREAM_KAFKA_SASL_PASSWORD": password,
            "STEPSTREAM_KAFKA_SSL_CA_LOCATION": str(self.ca),
        }

    def tls_env(self) -> dict[str, str]:
        """The documented variables for the SSL listener: TLS alone."""
        return {
            "STEPSTREAM_KAFKA_SECURITY_PROTOCOL": "SSL",
            "STEPSTREAM_KAFKA_SSL_CA_LOCATION": str(self.ca),
        }

    def stop(self) -> None:
        self.cluster.stop()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def start_secure_kafka(root: Path, extra: Mapping[str, str] | None = None) -> SecureKafka:
    """``extra``: more ``server.properties`` for the node (e.g. a short
    ``connections.max.reauth.ms``, so live connections log in again)."""
    certificates = make_certificates(root / "certificates")
    tls_port = _free_port()
    jaas = (
        "org.apache.kafka.common.security.scram.ScramLoginModule required "
        f'username="{BROKER_USER.name}" password="{BROKER_USER.password}";'
    )

    def secure(index: int, defaults: Mapping[str, str]) -> dict[str, str]:
        sasl = defaults["advertised.listeners"].replace("PLAINTEXT://", "SASL_SSL://")
        controller = defaults["listeners"].split(",")[1]
        return {
            "listeners": f"{sasl},TLS://127.0.0.1:{tls_port},{controller}",
            "advertised.listeners": f"{sasl},TLS://127.0.0.1:{tls_port}",
            "listener.security.protocol.map": "SASL_SSL:SASL_SSL,TLS:SSL,CONTROLLER:PLAINTEXT",
            "inter.broker.listener.name": "SASL_SSL",
            "sasl.enabled.mechanisms": MECHANISM,
            "sasl.mechanism.inter.broker.protocol": MECHANISM,
            f"listener.name.sasl_ssl.{MECHANISM.lower()}.sasl.jaas.config": jaas,
            "ssl.keystore.type": "PEM",
            "ssl.keystore.location": str(certificates.keystore),
            "ssl.truststore.type": "PEM",
            "ssl.truststore.location": str(certificates.ca),
            **(extra or {}),
        }

    client = {
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": MECHANISM,
        "sasl.username": USER,
        "sasl.password": PASSWORD,
        "ssl.ca.location": str(certificates.ca),
    }
    cluster = start_apache(
        1,
        overrides=secure,
        scram_users=(BROKER_USER, ScramUser(USER, PASSWORD, MECHANISM)),
        client_properties=client,
    )
    return SecureKafka(cluster, certificates, f"127.0.0.1:{tls_port}")


def _write_env(path: Path, bootstrap: str, env: Mapping[str, str]) -> None:
    every = {"STEPSTREAM_KAFKA_BOOTSTRAP_SERVERS": bootstrap, **env}
    path.write_text("".join(f"export {k}={shlex.quote(v)}\n" for k, v in every.items()))


def _stop(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tests.secure_kafka DIR", file=sys.stderr)
        return 2
    root = Path(argv[0]).resolve()
    files = (root / "sasl.env", root / "tls.env")
    for path in files:
        path.unlink(missing_ok=True)
    signal.signal(signal.SIGTERM, _stop)
    kafka = start_secure_kafka(root)
    try:
        _write_env(files[0], kafka.bootstrap, kafka.sasl_env())
        _write_env(files[1], kafka.tls_bootstrap, kafka.tls_env())
        print(f"SASL_SSL on {kafka.bootstrap}: {files[0]}", flush=True)
        print(f"SSL on {kafka.tls_bootstrap}: {files[1]}", flush=True)
        while True:
            signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        for path in files:
            path.unlink(missing_ok=True)
        kafka.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
