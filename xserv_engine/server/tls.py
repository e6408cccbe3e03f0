"""TLS for the engine's gRPC port: server certificate, and client certificates (mTLS) on request.

`xserv engine --grpc-tls-cert CERT --grpc-tls-key KEY` serves TLS only (no plaintext on the same
port); `--grpc-tls-client-ca CA` also requires every client to present a certificate signed by CA.
Plain files in PEM; read once at start, so a renewed certificate needs a restart (or a rolling
restart of the replicas, which drain).
"""

from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True)
class TlsFiles:
    cert: bytes  # PEM certificate chain of this server
    key: bytes  # PEM private key
    client_ca: bytes | None = None  # PEM CA bundle: when set, clients must present a certificate it signed


def tls_from_args(cert: str | None, key: str | None, client_ca: str | None) -> TlsFiles | None:
    """None for plaintext. ValueError for a flag without its partner, OSError naming a file
    that cannot be read."""
    if cert is None and key is None:
        if client_ca is not None:
            raise ValueError("--grpc-tls-client-ca needs --grpc-tls-cert and --grpc-tls-key")
        return None
    if cert is None or key is None:
        raise ValueError("--grpc-tls-cert and --grpc-tls-key go together")
    return TlsFiles(_read(cert), _read(key), _read(client_ca) if client_ca else None)


def server_credentials(tls: TlsFiles) -> grpc.ServerCredentials:
    return grpc.ssl_server_credentials([(tls.key, tls.cert)], root_certificates=tls.client_ca,
                                       require_client_auth=tls.client_ca is not None)


def _read(path: str) -> bytes:
    data = Path(path).read_bytes()
    if not data.strip():
        raise ValueError(f"{path}: the file is empty")
    return data
