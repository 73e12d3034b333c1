"""The rollout service's gate (serve.py): every route but /health and /attest takes only a request
signed with the job's token, checked before its body is parsed, a body within its limit; and every
answer to a signed request carries the engine's MAC over the request's nonce, its status and its
body (wire/auth.py holds the scheme)."""
from __future__ import annotations

import json

from spice_megatron.wire.auth import RESPONSE_MAC_HEADER, AuthError, RequestVerifier, request_nonce, response_mac

OPEN_ROUTES = ("/health", "/attest")  # everything else needs a signed request


def _refusal(status: int, detail: str) -> tuple[dict, dict]:
    body = json.dumps({"detail": detail}).encode()
    # connection: close: a refused body is not drained into the server's memory after the answer
    return ({"type": "http.response.start", "status": status,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                         (b"connection", b"close")]},
            {"type": "http.response.body", "body": body})


class SignedRequests:
    """ASGI middleware in front of every route: a body beyond the limit, of unknown length, or on a
    method that takes none is refused before it is read; a request's header is checked before its
    body is read and its signature before anything parses it (wire/auth.py); every answer to a
    signed request carries the engine's MAC over the request's nonce, its status and its body."""

    def __init__(self, app, verifier: RequestVerifier, token: str, max_bytes: int):
        self.app, self.verifier, self.token, self.max_bytes = app, verifier, token, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        if scope["method"] in ("POST", "PUT", "PATCH") and scope["path"] not in OPEN_ROUTES:
            refused = ((411, "a request body needs a Content-Length") if length is None else
                       (413, f"request body over {self.max_bytes} bytes")
                       if not length.isdigit() or int(length) > self.max_bytes else None)
        else:  # GET, HEAD, DELETE and the open routes: no body at all
            refused = ((413, f"{scope['method']} {scope['path']} takes no request body")
                       if b"transfer-encoding" in headers or length not in (None, b"0") else None)
        if refused is None and scope["path"] not in OPEN_ROUTES:
            header = headers.get(b"authorization", b"").decode("latin-1")
            try:
                path = (scope.get("raw_path") or scope["path"].encode()).decode("latin-1")
                if scope.get("query_string"):
                    path += "?" + scope["query_string"].decode("latin-1")
                self.verifier.verify_header(header, scope["method"], path)  # before any of the body is read
                body = await _read_body(receive, int(length or 0))
                self.verifier.verify(header, scope["method"], path, body)
            except AuthError as e:
                refused = (401, str(e))
        if refused is not None:
            for message in _refusal(*refused):
                await send(message)
            return
        if scope["path"] in OPEN_ROUTES:
            return await self.app(scope, receive, send)
        await self.app(scope, _replay(body, receive), self._signing(send, request_nonce(header)))

    def _signing(self, send, nonce: str):
        start: dict = {}
        chunks: list[bytes] = []

        async def signed_send(message):
            if message["type"] == "http.response.start":
                start.update(message)
                return
            if message["type"] != "http.response.body":
                return await send(message)
            chunks.append(message.get("body", b""))
            if message.get("more_body"):
                return
            body = b"".join(chunks)
            headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
            headers += [(b"content-length", str(len(body)).encode()),
                        (RESPONSE_MAC_HEADER.encode(), response_mac(self.token, nonce, start["status"], body).encode())]
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        return signed_send


async def _read_body(receive, length: int) -> bytes:
    chunks, got = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise AuthError("the client went away")
        chunk = message.get("body", b"")
        got += len(chunk)
        if got > length:
            raise AuthError("the body is longer than its Content-Length")
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


def _replay(body: bytes, receive):
    sent = [False]

    async def replayed():
        if not sent[0]:
            sent[0] = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
