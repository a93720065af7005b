"""Who may talk to ds3dd: the listen policy, TLS credentials, and two principals, clients and
peers.

Listen policy (checked before the server binds, so a mistake stops the daemon with a clear
message instead of exposing it): a loopback TCP address or a unix socket may run without TLS
and, unless a token file is given, without a client token — only local users reach it. Any
other address requires TLS with client certificates (mutual TLS) *and* a bearer token. Health
checks are answered without credentials so that load balancers and probes need no secret.

Principals. The node-to-node RPCs (`PEER_METHODS`: StartShare starts processes, ShareControl
writes control files, StopShare, PullReports, NodeStatus) are for the daemons of a job only,
never for a client, on any listen address, loopback included:

* a peer proves itself with the **peer token** (`--peer-token-file`, a secret of its own shared
  by the job's daemons, which must differ from the client token), and/or, under mutual TLS,
  with a **certificate whose name is a peer's** (`--peer-names`: the CN or a DNS/IP subject
  alternative name of each daemon's certificate). Every check configured must pass;
* a daemon with neither takes no part in multi-node jobs and refuses every peer RPC;
* the client token is valid on the client RPCs only, the peer token on the peer RPCs only.

Status codes as gRPC defines them: no credential, a token this daemon does not know, or more
than one `authorization` header (which one counts would be a guess: a proxy that appends a
header would decide it) is UNAUTHENTICATED; a valid credential of the wrong principal (a client
calling StartShare, a client certificate that is not a peer's) is PERMISSION_DENIED.
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
PEER_METHODS = frozenset(f"/ds3d.v1.Control/{m}" for m in (
    "StartShare", "ShareControl", "StopShare", "PullReports", "NodeStatus"))
PEER_TOKEN_HINT = ("start every daemon of a multi-node job with the same --peer-token-file (or, "
                   "under mutual TLS, --peer-names listing the daemons' certificate names)")


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


MAX_TOKEN_BYTES = 4096  # grpc refuses metadata above 8 KiB anyway
_NEW_TOKEN = "e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`"


def token_problem(token: str) -> str | None:
    """Why `token` cannot be a bearer token (None if it can): gRPC metadata is printable
    ASCII, and a space would split it."""
    if not (token.isascii() and token.isprintable() and " " not in token):
        return ("has spaces, control characters or non-ASCII characters inside; a token is "
                f"printable ASCII ({_NEW_TOKEN})")
    return None


def read_token(path: str | Path, flag: str = "--token-file") -> str:
    """The bearer token: the file's first line, at least 16 characters of printable ASCII.
    The file is a regular one of at most MAX_TOKEN_BYTES (a FIFO would block, /dev/zero fill
    memory); the same rules for ds3dd and ds3dctl, so that a token one accepts the other can
    send."""
    p = Path(path)
    try:
        if not p.is_file():
            raise ConfigError(f"{flag} {str(p)!r} does not exist or is not a regular file")
        size = p.stat().st_size
        if size > MAX_TOKEN_BYTES:
            raise ConfigError(f"{flag} {str(p)!r}: {size} bytes; a token file holds the token "
                              f"only (at most {MAX_TOKEN_BYTES} bytes)")
        text = p.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{flag} {str(p)!r} cannot be read: {e}") from None
    lines = text.strip().splitlines()
    token = lines[0].strip() if lines else ""
    if (why := token_problem(token)) is not None:
        raise ConfigError(f"{flag} {str(p)!r}: the token {why}")
    if len(token) < 16:
        raise ConfigError(f"{flag} {str(p)!r}: the token must be at least 16 characters "
                          f"({_NEW_TOKEN})")
    return token


@dataclass(frozen=True)
class PeerAuth:
    """How this daemon recognises the other daemons of a job (see the module docstring)."""

    token: str | None = None
    cert_names: frozenset[str] = frozenset()

    @property
    def configured(self) -> bool:
        return bool(self.token or self.cert_names)


def peer_auth(peer_token_file: str | None, peer_names: str | None, client_token: str | None,
              tls: TlsFiles | None) -> PeerAuth:
    """The peer credentials from ds3dd's flags, checked: a peer token distinct from the client
    token, peer names only with mutual TLS."""
    token = read_token(peer_token_file, "--peer-token-file") if peer_token_file else None
    if token is not None and client_token is not None and \
            hmac.compare_digest(token.encode(), client_token.encode()):
        raise ConfigError("--peer-token-file holds the client token: peers and clients are "
                          "different principals; give the daemons a peer token of their own")
    names = frozenset(n.strip() for n in (peer_names or "").split(",") if n.strip())
    if names and tls is None:
        raise ConfigError("--peer-names checks the certificate of the calling daemon, which "
                          "needs mutual TLS: add --tls-cert, --tls-key and --tls-ca, or use "
                          "--peer-token-file")
    return PeerAuth(token, names)


def certificate_names(context: grpc.ServicerContext) -> set[str]:
    """The caller's certificate names under mutual TLS: its CN and subject alternative names."""
    auth = context.auth_context() or {}
    return {v.decode(errors="replace") for key in ("x509_common_name",
                                                   "x509_subject_alternative_name")
            for v in auth.get(key, [])}


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


class AuthInterceptor(grpc.ServerInterceptor):
    """Clients and peers (module docstring): the bearer token of `authorization` metadata, and
    for the peer RPCs the peer credential (token and/or certificate name)."""

    def __init__(self, client_token: str | None, peer: PeerAuth) -> None:
        self._client = client_token.encode() if client_token else None
        self._peer = peer
        self._peer_token = peer.token.encode() if peer.token else None

    def _role(self, given: bytes) -> str | None:
        if self._client is not None and hmac.compare_digest(given, self._client):
            return "client"
        if self._peer_token is not None and hmac.compare_digest(given, self._peer_token):
            return "peer"
        return None

    def intercept_service(self, continuation: Callable[[Any], Any],
                          handler_call_details: grpc.HandlerCallDetails) -> Any:
        method = handler_call_details.method
        if method.startswith(UNAUTHENTICATED_METHODS):
            return continuation(handler_call_details)
        headers = [str(v) for k, v in handler_call_details.invocation_metadata or ()
                   if k == "authorization"]
        if len(headers) > 1:
            return _refuse(continuation(handler_call_details), UnauthenticatedError(
                f"the request carries {len(headers)} authorization headers; send exactly one, "
                "`authorization: Bearer TOKEN` (a proxy or client that adds its own must "
                "replace the header, not add another)"))
        header = headers[0] if headers else ""
        scheme, _, given = header.partition(" ")
        token = given.strip().encode() if header else None
        role = self._role(token) if token is not None and scheme.lower() == "bearer" else None
        peer_call = method in PEER_METHODS
        needs_token = peer_call and self._peer_token is not None or \
            not peer_call and self._client is not None
        err: PermissionError_ | None = None
        if header and scheme.lower() != "bearer" and needs_token:
            err = UnauthenticatedError(
                "the authorization header does not start with the Bearer scheme (not "
                "echoed: it may hold the token): send `authorization: Bearer TOKEN`")
        elif header and role is None and needs_token:
            err = UnauthenticatedError(
                "the bearer token is wrong" + ("; node-to-node calls need the peer token of "
                                               "--peer-token-file" if peer_call else
                                               "; use the token in the daemon's --token-file"))
        elif peer_call:
            err = self._peer_refusal(method, role)
        elif self._client is not None and role != "client":
            err = UnauthenticatedError(
                "this daemon requires a bearer token: pass --token-file FILE or set DS3D_TOKEN"
            ) if role is None else PermissionError_(
                f"{method.rsplit('/', 1)[-1]}: the peer credential is for node-to-node calls "
                "only; clients use the token of the daemon's --token-file")
        handler = continuation(handler_call_details)
        if err is not None:
            return _refuse(handler, err)
        if peer_call and self._peer.cert_names:
            return _with_certificate_check(handler, self._peer.cert_names)
        return handler

    def _peer_refusal(self, method: str, role: str | None) -> PermissionError_ | None:
        rpc = method.rsplit("/", 1)[-1]
        if not self._peer.configured:
            return PermissionError_(f"{rpc} is a node-to-node call and this daemon accepts "
                                    f"none: {PEER_TOKEN_HINT}")
        if self._peer_token is None:
            return None  # the certificate decides
        if role is None:
            return UnauthenticatedError(f"{rpc} is a node-to-node call: it needs the peer token "
                                        "of --peer-token-file")
        if role != "peer":
            return PermissionError_(f"{rpc} is a node-to-node call: a client credential cannot "
                                    "make it; only the job's daemons, with the peer token")
        return None


def _with_certificate_check(handler: Any, names: frozenset[str]) -> Any:
    """The peer RPC's handler, answering PERMISSION_DENIED unless the caller's certificate
    (mutual TLS) carries one of the peer `names`."""
    inner = handler.unary_unary

    def guarded(request: Any, context: grpc.ServicerContext) -> Any:
        have = certificate_names(context)
        if not have & names:
            err = PermissionError_(
                f"the calling certificate ({', '.join(sorted(have)) or 'none'}) is not a peer's: "
                f"node-to-node calls are for the daemons named in --peer-names "
                f"({', '.join(sorted(names))})")
            context.abort(status_code(err), str(err))
        return inner(request, context)

    return grpc.unary_unary_rpc_method_handler(
        guarded, request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer)


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
