"""The rollout plane's authentication: the shared token never crosses the wire.

- An engine proves it holds the token before the trainer trusts it: the client sends a fresh
  nonce to `/attest`, the engine answers HMAC(token, "spice-engine-attest" | nonce | the port its
  socket is bound to | a random id of this engine process). The client checks the proof against
  the port it dialled, so a squatter on an engine's port cannot relay `/attest` to a sibling engine
  of the same job (every engine of a job listens on its own port), and learns the instance id.
- Every other request carries `Authorization: SPICE-HMAC ts=..,nonce=..,mac=..` with the MAC over
  method, full path (query string included), time, nonce, the body's SHA-256 and the engine's
  instance id; the engine refuses an old time (more than MAX_SKEW_S away), a nonce it has already
  seen and a request signed for another instance, so a recorded request replays neither at this
  engine, nor at a sibling, nor at a restarted one.
- Every answer to a signed request carries `X-Spice-MAC`: HMAC(token, request nonce | status |
  body's SHA-256); the client refuses an answer without it.
- Weight-sync buckets are signed with a key derived per sync (`sync_key`): the trainer sends the
  sync's nonce over the signed HTTP plane, engines derive the same key from the token.

Imports only entry.py of the package: the server, the fleet client and the weight sync use it.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import stat
import threading
import time
from collections import OrderedDict

from spice_megatron.entry import UserError

SCHEME = "SPICE-HMAC"
MAX_SKEW_S = 300.0  # a signed request older (or newer) than this is refused
TOKEN_ENV = "SPICE_ROLLOUT_TOKEN"
TOKEN_FILE_ENV = "SPICE_ROLLOUT_TOKEN_FILE"
RESPONSE_MAC_HEADER = "x-spice-mac"


class AuthError(UserError):
    pass


def mac(key: str | bytes, message: bytes) -> str:
    """HMAC-SHA256, hex: of requests and attestations (key: the token), of sync buckets (a sync key)."""
    return hmac.new(key.encode() if isinstance(key, str) else key, message, hashlib.sha256).hexdigest()


def attest_proof(token: str, nonce: str, port: int, instance: str, host: str = "") -> str:
    """`host`: the address the engine's socket is bound to ("" where it listens on every interface)."""
    return mac(token, f"spice-engine-attest\n{nonce}\n{port}\n{instance}\n{host}".encode())


def new_nonce() -> str:
    return secrets.token_hex(16)


def check_attestation(token: str, nonce: str, port: int, instance: object, proof: object, host: object = "") -> bool:
    return (isinstance(proof, str) and isinstance(instance, str) and isinstance(host, str)
            and hmac.compare_digest(proof.encode(), attest_proof(token, nonce, port, instance, host).encode()))


def _addresses(host: str) -> set[str]:
    import ipaddress

    try:
        found = {info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except OSError:
        return set()
    return {str(ipaddress.ip_address(a.split("%")[0])) for a in found}


def _request_message(method: str, path: str, ts: str, nonce: str, body_sha: str, instance: str) -> bytes:
    return "\n".join((method.upper(), path, ts, nonce, body_sha, instance)).encode()


def sign_request(token: str, method: str, path: str, body: bytes = b"", instance: str = "") -> str:
    """The Authorization header of one request to engine process `instance` (`path` with its query). It
    names the body's SHA-256 (signed): the engine checks the header before it reads any of the body."""
    ts, nonce, sha = f"{time.time():.3f}", new_nonce(), hashlib.sha256(body).hexdigest()
    signature = mac(token, _request_message(method, path, ts, nonce, sha, instance))
    return f"{SCHEME} ts={ts},nonce={nonce},sha={sha},mac={signature}"


def request_nonce(header: str) -> str:
    """The nonce of a signed request's Authorization header ("" when it has none)."""
    for part in header.partition(" ")[2].split(","):
        if part.startswith("nonce="):
            return part[len("nonce="):]
    return ""


def response_mac(token: str, nonce: str, status: int, body: bytes) -> str:
    return mac(token, f"spice-engine-response\n{nonce}\n{status}\n{hashlib.sha256(body).hexdigest()}".encode())


class RequestVerifier:
    """The engine's side: checks a request's signature, remembering nonces for MAX_SKEW_S."""

    def __init__(self, token: str, instance: str, max_nonces: int = 100_000):
        self.token, self.instance, self.max_nonces = token, instance, max_nonces
        self._seen: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def check_header(self, header: str) -> tuple[str, str, str, str]:
        """(ts, nonce, body sha, mac) of a well-formed, timely header."""
        scheme, _, rest = header.partition(" ")
        if scheme != SCHEME:
            raise AuthError("missing or unsigned Authorization header")
        try:
            fields = dict(part.split("=", 1) for part in rest.split(","))
            ts, nonce, sha, given = fields["ts"], fields["nonce"], fields["sha"], fields["mac"]
            when = float(ts)
        except (ValueError, KeyError) as e:
            raise AuthError("malformed Authorization header") from e
        now = time.time()
        if abs(now - when) > MAX_SKEW_S:
            raise AuthError(f"request time is {now - when:+.0f}s off this engine's clock (at most {MAX_SKEW_S:.0f}s)")
        return ts, nonce, sha, given

    def verify_header(self, header: str, method: str, path: str) -> None:
        """The header's signature over method, path, time, nonce and the body's announced SHA-256: checked
        before any of the body is read, so an unsigned request costs the engine no buffered body
        (docs/cluster.md, "Engines cannot be impersonated")."""
        ts, nonce, sha, given = self.check_header(header)
        message = _request_message(method, path, ts, nonce, sha, self.instance)
        if not hmac.compare_digest(given.encode(), mac(self.token, message).encode()):
            raise AuthError("wrong signature (not signed with this job's token for this engine process)")

    def verify(self, header: str, method: str, path: str, body: bytes) -> None:
        """The whole request: its header (verify_header), the body against the signed SHA-256, no replay."""
        self.verify_header(header, method, path)
        _, nonce, sha, _ = self.check_header(header)
        if not hmac.compare_digest(sha.encode(), hashlib.sha256(body).hexdigest().encode()):
            raise AuthError("the body is not the one signed")
        now = time.time()
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
                raise AuthError(f"token file {path}: mode {stat.S_IMODE(st.st_mode):o} lets others read it; chmod 600 "
                                "it")
            with open(path) as f:
                token = f.read().strip()
        except OSError as e:
            raise AuthError(f"token file {path}: {e.strerror}") from e
        if not token:
            raise AuthError(f"token file {path} is empty")
        return token
    return os.environ.get(TOKEN_ENV, "")


# the instance id each engine proved with its last attestation, by base URL (per process: every
# request to an engine is signed for the process that proved it holds the token)
_instances: dict[str, str] = {}
_instances_lock = threading.Lock()


def _port_of(url: str) -> int:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    return parts.port or (443 if parts.scheme == "https" else 80)


def signed_request(method: str, url: str, path: str, token: str, body: object = None,
                   timeout: float = 600.0):
    """One request to an engine, signed for the engine process that last proved it holds the token
    at `url` (attested first if none has), its answer checked for the engine's MAC. The body is sent
    as the exact JSON bytes that were signed. A 401 (a restarted engine: another process) attests
    again and retries once."""
    import json

    import requests

    data = b"" if body is None else json.dumps(body).encode()
    for attempt in (0, 1):
        with _instances_lock:
            instance = _instances.get(url)
        if instance is None:
            instance = attest(url, token, timeout=min(timeout, 30.0))
        header = sign_request(token, method, path, data, instance)
        headers = {"Authorization": header}
        if body is not None:
            headers["Content-Type"] = "application/json"
        r = requests.request(method, url + path, data=data or None, headers=headers, timeout=timeout)
        if r.status_code == 401 and attempt == 0:
            with _instances_lock:
                _instances.pop(url, None)
            continue
        if r.status_code < 400:
            given = r.headers.get(RESPONSE_MAC_HEADER, "")
            if not hmac.compare_digest(given.encode(), response_mac(token, request_nonce(header), r.status_code,
                                                                    r.content).encode()):
                with _instances_lock:
                    _instances.pop(url, None)
                raise AuthError(f"the answer from {url}{path.split('?')[0]} is not signed by the engine that was "
                                "asked: refused")
        return r
    return r


def attest(url: str, token: str, timeout: float = 10.0) -> str:
    """The instance id of the engine process at `url`; raises AuthError unless it proves it holds
    `token` for the port `url` names (requests' errors pass)."""
    import requests

    nonce = new_nonce()
    r = requests.get(url + "/attest", params={"nonce": nonce}, timeout=timeout)
    answer = r.json() if r.ok and r.headers.get("content-type", "").startswith("application/json") else {}
    answer = answer if isinstance(answer, dict) else {}
    instance, bound = answer.get("instance"), answer.get("host", "")
    if not check_attestation(token, nonce, _port_of(url), instance, answer.get("proof"), bound):
        with _instances_lock:
            _instances.pop(url, None)
        raise AuthError(f"the process answering at {url} could not prove it holds this job's token: not our engine "
                        "(another process on its port?); nothing was sent to it")
    from urllib.parse import urlsplit

    dialled = urlsplit(url).hostname or ""
    if bound and bound not in _addresses(dialled):  # proved for another address: a relay
        with _instances_lock:
            _instances.pop(url, None)
        raise AuthError(f"the engine answering at {url} proved it holds this job's token for {bound}, an address "
                        f"{dialled} does not name: another process relays to it; nothing was sent to it")
    with _instances_lock:
        _instances[url] = instance
    return instance
