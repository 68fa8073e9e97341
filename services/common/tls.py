"""TLS for gRPC between specd services: one config, server credentials, client channel credentials.

Every service has one identity and one trust root, used both ways:
- `cert_file` / `key_file` (PEM): the certificate chain and key its gRPC servers present; as a
  client it presents them too when a server asks for a client certificate (mutual TLS).
- `ca_file` (PEM): the CA bundle it trusts when it connects to another specd service; setting it
  turns TLS on for outgoing channels.
- `client_ca_file` (PEM): its servers then require client certificates signed by this CA.

Nothing set means plaintext (loopback and private networks). The files are read once,
at startup, so a missing or unreadable file fails the service before it serves anything.
grpc is imported where credentials are made, so command lines can add the flags cheaply.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path


def _read(path: str, field: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"{field}: cannot read {path!r}: {e.strerror or e}") from None


@dataclass(frozen=True)
class TLSConfig:
    """Which PEM files a service uses for gRPC TLS; validated on construction."""

    cert_file: str = ""
    key_file: str = ""
    ca_file: str = ""
    client_ca_file: str = ""

    def __post_init__(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("tls_cert_file / tls_key_file: give both or neither")
        if self.client_ca_file and not self.cert_file:
            raise ValueError("tls_client_ca_file: requiring client certificates needs the server's own "
                             "--tls-cert-file and --tls-key-file")

    @property
    def serves_tls(self) -> bool:
        return bool(self.cert_file)

    @property
    def connects_tls(self) -> bool:
        return bool(self.ca_file)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "TLSConfig":
        return cls(cert_file=getattr(args, "tls_cert_file", "") or "", key_file=getattr(args, "tls_key_file", "") or "",
                   ca_file=getattr(args, "tls_ca_file", "") or "",
                   client_ca_file=getattr(args, "tls_client_ca_file", "") or "")

    def to_flags(self) -> list[str]:
        """The command-line flags that recreate this config in a child process."""
        flags = []
        for name in ("cert_file", "key_file", "ca_file", "client_ca_file"):
            if getattr(self, name):
                flags += [f"--tls-{name.replace('_', '-')}", getattr(self, name)]
        return flags


PLAINTEXT = TLSConfig()


def add_tls_arguments(parser: argparse.ArgumentParser, *, server: bool = True, client: bool = True) -> None:
    """The TLS flags of a service: server ones where it serves gRPC, client ones where it connects."""
    group = parser.add_argument_group("TLS for gRPC between services (PEM files; default: plaintext)")
    group.add_argument("--tls-cert-file", default="",
                       help="certificate chain this service presents (its gRPC server; client certificate "
                            "for servers that require one)")
    group.add_argument("--tls-key-file", default="", help="private key of --tls-cert-file")
    if client:
        group.add_argument("--tls-ca-file", default="",
                           help="CA bundle that other specd services' certificates are verified against; "
                                "turns TLS on for outgoing connections")
    if server:
        group.add_argument("--tls-client-ca-file", default="",
                           help="require client certificates signed by this CA (mutual TLS)")


def server_credentials(tls: TLSConfig) -> grpc.ServerCredentials | None:
    """TLS server credentials, or None for plaintext."""
    import grpc

    if not tls.serves_tls:
        return None
    pair = [(_read(tls.key_file, "tls_key_file"), _read(tls.cert_file, "tls_cert_file"))]
    if tls.client_ca_file:
        return grpc.ssl_server_credentials(pair, root_certificates=_read(tls.client_ca_file, "tls_client_ca_file"),
                                           require_client_auth=True)
    return grpc.ssl_server_credentials(pair)


def add_port(server, address: str, tls: TLSConfig) -> int:
    """Bind `address` on a grpc (sync or aio) server, with TLS when configured; returns the port."""
    credentials = server_credentials(tls)
    if credentials is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, credentials)


def channel_credentials(tls: TLSConfig) -> grpc.ChannelCredentials | None:
    """TLS credentials for channels to other specd services, or None for plaintext."""
    import grpc

    if not tls.connects_tls:
        return None
    cert = _read(tls.cert_file, "tls_cert_file") if tls.cert_file else None
    key = _read(tls.key_file, "tls_key_file") if tls.key_file else None
    return grpc.ssl_channel_credentials(root_certificates=_read(tls.ca_file, "tls_ca_file"),
                                        private_key=key, certificate_chain=cert)


def open_channel(address: str, tls: TLSConfig = PLAINTEXT, options=None) -> grpc.Channel:
    """A sync channel to `address`, secure when `tls` trusts a CA."""
    import grpc

    credentials = channel_credentials(tls)
    if credentials is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, credentials, options=options)
