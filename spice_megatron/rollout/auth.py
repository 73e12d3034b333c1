"""The rollout plane's authentication: the shared token never crosses the wire.

- An engine proves it holds the token before the trainer trusts it: the client sends a fresh
  nonce to `/attest`, the engine answers HMAC(token, "spice-engine-attest" | nonce). A process
  that squats an engine's port cannot answer, so it never receives a prompt or a signed request.
- Every other request carries `Authorization: SPICE-HMAC ts=..,nonce=..,mac=..` with the MAC over
  method, path, time, nonce and the body's SHA-256; the engine refuses an old time (more than
  MAX_SKEW_S away) and a nonce it has already seen, so a recorded request cannot be replayed.
- Weight-sync buckets are signed with a key derived per sync (`sync_key`): the trainer sends the
  sync's nonce over the signed HTTP plane, engines derive the same key from the token.

Imports only entry.py of the package: the server, the fleet client and the weight sync use it.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import threading
import time
from collections import OrderedDict

from spice_megatron.entry import UserError

SCHEME = "SPICE-HMAC"
MAX_SKEW_S = 300.0  # a signed request older (or newer) than this is refused
TOKEN_ENV = "SPICE_ROLLOUT_TOKEN"
TOKEN_FILE_ENV = "SPICE_ROLLOUT_TOKEN_FILE"


class AuthError(UserError):
    pass


def mac(key: str | bytes, message: bytes) -> str:
    """HMAC-SHA256, hex: of requests and attestations (key: the token), of sync buckets (a sync key)."""
    return hmac.new(key.encode() if isinstance(key, str) else key, message, hashlib.sha256).hexdigest()


def attest_proof(token: str, nonce: str) -> str:
    return mac(token, b"spice-engine-attest\n" + nonce.encode())


def new_nonce() -> str:
    return secrets.token_hex(16)


def check_attestation(token: str, nonce: str, proof: object) -> bool:
    return isinstance(proof, str) and hmac.compare_digest(proof.encode(), attest_proof(token, nonce).encode())


def _request_message(method: str, path: str, ts: str, nonce: str, body: bytes) -> bytes:
    return "\n".join((method.upper(), path, ts, nonce, hashlib.sha256(body).hexdigest())).encode()


def sign_request(token: str, method: str, path: str, body: bytes = b"") -> str:
    """The Authorization header of one request (`path` without the query string)."""
    ts, nonce = f"{time.time():.3f}", new_nonce()
    return f"{SCHEME} ts={ts},nonce={nonce},mac={mac(token, _request_message(method, path, ts, nonce, body))}"


class RequestVerifier:
    """The engine's side: checks a request's signature, remembering nonces for MAX_SKEW_S."""

    def __init__(self, token: str, max_nonces: int = 100_000):
        self.token, self.max_nonces = token, max_nonces
        self._seen: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def verify(self, header: str, method: str, path: str, body: bytes) -> None:
        scheme, _, rest = header.partition(" ")
        if scheme != SCHEME:
            raise AuthError("missing or unsigned Authorization header")
        try:
            fields = dict(part.split("=", 1) for part in rest.split(","))
            ts, nonce, given = fields["ts"], fields["nonce"], fields["mac"]
            when = float(ts)
        except (ValueError, KeyError) as e:
            raise AuthError("malformed Authorization header") from e
        now = time.time()
        if abs(now - when) > MAX_SKEW_S:
            raise AuthError(f"request time is {now - when:+.0f}s off this engine's clock (at most {MAX_SKEW_S:.0f}s)")
        if not hmac.compare_digest(given.encode(), mac(self.token, _request_message(method, path, ts, nonce, body)).encode()):
            raise AuthError("wrong signature")
        with self._lock:
            while self._seen and (next(iter(self._seen.values())) < now - 2 * MAX_SKEW_S
                                  or len(self._seen) >= self.max_nonces):
                self._seen.popitem(last=False)
            if nonce in self._seen:
                raise AuthError("replayed request")
            self._seen[nonce] = now


def sync_key(token: str, nonce: str) -> bytes:
    """The key that signs one weight sync's buckets (sender and engines derive it alike)."""
    return hmac.new(token.encode(), b"spice-weight-sync\n" + nonce.encode(), hashlib.sha256).digest()


def read_token(path: str | None = None) -> str:
    """The job's token: $SPICE_ROLLOUT_TOKEN, or the file named by `path` / $SPICE_ROLLOUT_TOKEN_FILE,
    which must be readable by its owner alone. Empty when neither is set."""
    path = path or os.environ.get(TOKEN_FILE_ENV)
    if path:
        try:
            st = os.stat(path)
            if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
                raise AuthError(f"token file {path}: mode {stat.S_IMODE(st.st_mode):o} lets others read it; chmod 600 it")
            with open(path) as f:
                token = f.read().strip()
        except OSError as e:
            raise AuthError(f"token file {path}: {e.strerror}") from e
        if not token:
            raise AuthError(f"token file {path} is empty")
        return token
    return os.environ.get(TOKEN_ENV, "")


def signed_request(method: str, url: str, path: str, token: str, body: object = None,
                   timeout: float = 600.0):
    """One request to an engine, signed (`url`: the engine's base address). The body is sent as
    the exact JSON bytes that were signed."""
    import json

    import requests

    data = b"" if body is None else json.dumps(body).encode()
    headers = {"Authorization": sign_request(token, method, path.split("?", 1)[0], data)}
    if body is not None:
        headers["Content-Type"] = "application/json"
    return requests.request(method, url + path, data=data or None, headers=headers, timeout=timeout)


def attest(url: str, token: str, timeout: float = 10.0) -> None:
    """Raises AuthError unless the engine at `url` proves it holds `token` (requests' errors pass)."""
    import requests

    nonce = new_nonce()
    r = requests.get(url + "/attest", params={"nonce": nonce}, timeout=timeout)
    proof = r.json().get("proof") if r.ok and r.headers.get("content-type", "").startswith("application/json") else None
    if not check_attestation(token, nonce, proof):
        raise AuthError(f"the process answering at {url} could not prove it holds this job's token: not our engine "
                        "(another process on its port?); nothing was sent to it")
