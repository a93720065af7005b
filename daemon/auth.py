"""Who may talk to ds3dd: the listen policy, TLS credentials and the bearer-token check.

Policy (checked before the server binds, so a mistake stops the daemon with a clear message
instead of exposing it): a loopback TCP address or a unix socket may run without TLS and, unless
a token file is given, without a token — only local users reach it. Any other address requires
TLS with client certificates (mutual TLS: the daemons of a multi-node job authenticate each
other by certificate, clients too) *and* a bearer token. Health checks are answered without a
token so that load balancers and probes need no secret.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from ds3d.trainer.errors import ConfigError, PermissionError_

from .errors import UnauthenticatedError, status_code

UNAUTHENTICATED_METHODS = ("/grpc.health.v1.Health/",)


def is_local_address(listen: str) -> bool:
    """True for `unix:PATH` and loopback TCP addresses (127.0.0.0/8, ::1, localhost)."""
    if listen.startswith("unix:"):
        return True
    host = listen.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name or 0.0.0.0 / [::]: reachable from elsewhere


@dataclass(frozen=True)
class TlsFiles:
    cert: Path
    key: Path
    ca: Path

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.key.read_bytes(), self.cert.read_bytes())],
            root_certificates=self.ca.read_bytes(), require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca.read_bytes(), private_key=self.key.read_bytes(),
            certificate_chain=self.cert.read_bytes())


def read_token(path: str | Path) -> str:
    """The bearer token: the file's first line, at least 16 characters."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--token-file {str(p)!r} does not exist")
    token = p.read_text().strip().splitlines()[0].strip() if p.read_text().strip() else ""
    if len(token) < 16:
        raise ConfigError(f"--token-file {str(p)!r}: the token must be at least 16 characters "
                          "(e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)")
    return token


def check_listen_policy(listen: str, tls: TlsFiles | None, token: str | None) -> None:
    """Refuses to expose the daemon beyond this machine without mutual TLS and a token."""
    if is_local_address(listen):
        return
    missing = []
    if tls is None:
        missing.append("--tls-cert, --tls-key and --tls-ca (mutual TLS)")
    if token is None:
        missing.append("--token-file (bearer token)")
    if missing:
        raise ConfigError(
            f"refusing to listen on {listen!r}: it is reachable from other machines, which "
            f"requires {' and '.join(missing)}; or listen on loopback (127.0.0.1:7531) or a "
            "unix socket (unix:/run/ds3d.sock)")


def tls_files(cert: str | None, key: str | None, ca: str | None) -> TlsFiles | None:
    """All three files or none; each must exist."""
    given = {"--tls-cert": cert, "--tls-key": key, "--tls-ca": ca}
    if not any(given.values()):
        return None
    absent = [flag for flag, v in given.items() if not v]
    if absent:
        raise ConfigError(f"TLS needs all of --tls-cert, --tls-key and --tls-ca; missing "
                          f"{', '.join(absent)}")
    for flag, v in given.items():
        if not Path(v or "").is_file():
            raise ConfigError(f"{flag} {v!r} does not exist")
    return TlsFiles(Path(cert or ""), Path(key or ""), Path(ca or ""))


class TokenInterceptor(grpc.ServerInterceptor):  # type: ignore[misc]  # grpc has no stubs here
    """Requires `authorization: Bearer <token>` metadata on every RPC except health checks."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

    def intercept_service(self, continuation: Callable[[Any], Any],
                          handler_call_details: grpc.HandlerCallDetails) -> Any:
        method = handler_call_details.method
        if method.startswith(UNAUTHENTICATED_METHODS):
            return continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        header = metadata.get("authorization", "")
        if not header:
            return _refuse(continuation(handler_call_details), UnauthenticatedError(
                "this daemon requires a bearer token: pass --token-file FILE or set "
                "DS3D_TOKEN"))
        scheme, _, given = str(header).partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(),
                                                                 self._token):
            return _refuse(continuation(handler_call_details), PermissionError_(
                "the bearer token is wrong; use the token in the daemon's --token-file"))
        return continuation(handler_call_details)


def _refuse(handler: Any, err: PermissionError_) -> Any:
    """A handler of the same shape as the real one that only answers with `err`."""

    def abort(_request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(status_code(err), str(err))

    if handler is not None and handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(
            abort, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)
    return grpc.unary_unary_rpc_method_handler(
        abort, request_deserializer=getattr(handler, "request_deserializer", None),
        response_serializer=getattr(handler, "response_serializer", None))
