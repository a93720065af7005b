"""The one place where ds3d errors become gRPC status codes.

Servicer code raises `Ds3dError` subclasses (checkpoints/errors.py: each names its status as a
string, so the trainer never imports grpc). `ErrorInterceptor` wraps every handler: a Ds3dError
becomes its status code with its message; anything else is a bug, logged with its traceback and
answered INTERNAL with a reference the operator can find in the daemon log — never the traceback.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from ds3d.trainer.errors import Ds3dError, PermissionError_

from .logging import get_logger

log = get_logger("ds3d.rpc")


class UnauthenticatedError(PermissionError_):
    """Missing or unknown credentials (no bearer token, a token this daemon does not know):
    UNAUTHENTICATED, as gRPC defines it; a valid credential of the wrong principal (a client on
    a peer RPC) is PERMISSION_DENIED."""

    grpc_code = "UNAUTHENTICATED"


class LongCallLimitError(Ds3dError):
    """Every slot for a long call is taken (a followed event watch, a checkpoint verify): each
    holds one of the daemon's RPC threads for as long as it runs, so past the limit no other
    call would get an answer."""

    grpc_code = "RESOURCE_EXHAUSTED"
    retryable = True


def status_code(err: Ds3dError) -> grpc.StatusCode:
    """Ds3dError.grpc_code (a string) -> grpc.StatusCode; an unknown name is a bug -> INTERNAL."""
    return getattr(grpc.StatusCode, err.grpc_code, grpc.StatusCode.INTERNAL)


# Trailing metadata on every refusal: tells a client that ds3dd itself answered (an UNAVAILABLE
# from an unreachable S3 store is not an unreachable daemon).
ANSWERED_BY = ("ds3d-error", "1")


# Most bytes of a status message as sent: grpc carries it percent-encoded in a header, and a
# client drops a call whose headers pass 16 KiB ("Stream removed"), losing the refusal.
STATUS_MESSAGE_MAX_BYTES = 8192


def fitted(message: str) -> str:
    """`message` cut where its percent-encoded form would pass STATUS_MESSAGE_MAX_BYTES (a
    refusal that quotes a huge request field still reaches the client, shortened)."""
    room, size = STATUS_MESSAGE_MAX_BYTES - 64, 0
    for i, ch in enumerate(message[:STATUS_MESSAGE_MAX_BYTES]):
        size += sum(1 if 0x20 <= b <= 0x7E and b != 0x25 else 3 for b in ch.encode())
        if size > room:
            return f"{message[:i]}... [cut: {len(message)} characters in all]"
    return message


def quoted(value: str, limit: int = 80) -> str:
    """A request's string as a refusal quotes it: repr, shortened past `limit` characters."""
    return repr(value) if len(value) <= limit else f"{value[:limit]!r}... ({len(value)} characters)"


def _abort(context: grpc.ServicerContext, method: str, exc: BaseException) -> None:
    if isinstance(exc, Ds3dError):
        log.info("rpc refused", method=method, code=exc.grpc_code, error=fitted(str(exc)))
        context.set_trailing_metadata((ANSWERED_BY,))
        context.abort(status_code(exc), fitted(str(exc)))
    ref = uuid.uuid4().hex[:12]
    log.error("rpc failed", method=method, ref=ref, exc_info=exc)
    context.abort(grpc.StatusCode.INTERNAL,
                  f"internal error in {method.rsplit('/', 1)[-1]} (a bug in ds3dd); "
                  f"the daemon log has the details under ref={ref}")


def _already_aborted(context: grpc.ServicerContext) -> bool:
    code = getattr(context, "code", None)
    return callable(code) and code() not in (None, grpc.StatusCode.OK)


class MalformedRequest:
    """What a request deserializer returns instead of raising: grpcio answers a deserializer
    that raises with INTERNAL ("Exception deserializing request!"), but bytes that are not the
    method's message are the client's error (INVALID_ARGUMENT)."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # protobuf's DecodeError and friends: the bytes are bad
            return MalformedRequest(exc)

    return deserialize


def _refuse_malformed(context: grpc.ServicerContext, method: str,
                      request: MalformedRequest) -> None:
    log.info("rpc refused", method=method, code="INVALID_ARGUMENT", error="malformed request")
    context.set_trailing_metadata((ANSWERED_BY,))
    context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                  f"the request is not a valid {method.rsplit('/', 1)[-1]} message (protobuf "
                  f"decoding failed: {str(request.error)[:200]}); send the method's request "
                  "message (ds3d's are in protos/ds3d/v1/control.proto; server reflection "
                  "describes every service)")


class ErrorInterceptor(grpc.ServerInterceptor):
    """Maps exceptions of every handler to status codes, answers undecodable request bytes with
    INVALID_ARGUMENT, and counts every call by method (`on_call`, e.g. the Prometheus RPC
    counter)."""

    def __init__(self, on_call: Callable[[str], None] | None = None) -> None:
        self.on_call = on_call

    def intercept_service(self, continuation: Callable[[Any], Any],
                          handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        if self.on_call is not None:
            self.on_call(method)
        if handler.unary_unary is not None:
            inner_uu = handler.unary_unary

            def unary(request: Any, context: grpc.ServicerContext) -> Any:
                if isinstance(request, MalformedRequest):
                    _refuse_malformed(context, method, request)
                try:
                    return inner_uu(request, context)
                except Exception as exc:
                    if _already_aborted(context):
                        raise
                    _abort(context, method, exc)

            return grpc.unary_unary_rpc_method_handler(
                unary, request_deserializer=_tolerant(handler.request_deserializer),
                response_serializer=handler.response_serializer)
        if handler.unary_stream is not None:
            inner_us = handler.unary_stream

            def stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                if isinstance(request, MalformedRequest):
                    _refuse_malformed(context, method, request)
                try:
                    yield from inner_us(request, context)
                except Exception as exc:
                    if _already_aborted(context):
                        raise
                    _abort(context, method, exc)

            return grpc.unary_stream_rpc_method_handler(
                stream, request_deserializer=_tolerant(handler.request_deserializer),
                response_serializer=handler.response_serializer)
        if handler.stream_stream is not None:  # server reflection
            inner_ss = handler.stream_stream

            def bidi(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
                def checked() -> Iterator[Any]:
                    for request in requests:
                        if isinstance(request, MalformedRequest):
                            _refuse_malformed(context, method, request)
                        yield request

                try:
                    yield from inner_ss(checked(), context)
                except Exception as exc:
                    if _already_aborted(context):
                        raise
                    _abort(context, method, exc)

            return grpc.stream_stream_rpc_method_handler(
                bidi, request_deserializer=_tolerant(handler.request_deserializer),
                response_serializer=handler.response_serializer)
        return handler
