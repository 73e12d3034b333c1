"""An engine across nodes: vLLM's message queues between its nodes (shm_broadcast.MessageQueue: the
scheduler's broadcast of every step and every collective_rpc to the other nodes' workers, and their
replies, ZeroMQ over TCP) authenticated and encrypted with CurveZMQ (docs/cluster.md, "An engine across nodes").

vLLM binds those queues unauthenticated on the node's address: anyone who reaches it subscribes and
reads every prompt's token ids. A vLLM general plugin (setup.py) runs `encrypt_engine_channels` in
every process vLLM starts; where the job token is in the environment (every process of the job's
engines has it) each queue socket that binds a TCP address becomes a CURVE server and each that
connects to one a CURVE client, with keys derived from the token: the server's key is never sent,
so a peer without the token can neither complete the handshake nor read what passes (its
connection is dropped by ZeroMQ; nothing reaches vLLM). Local queues (shared memory, ipc) are
left as they are. Both ends must run the plugin: a job's leader and followers do.
"""
from __future__ import annotations

import hashlib
import hmac
import os

_PATCHED = False


def _keypair(token: str, role: str) -> tuple[bytes, bytes]:
    """(public, secret) Z85 keys of `role`, derived from the job token (the same on every node)."""
    import zmq
    from zmq.utils import z85

    secret = z85.encode(hmac.new(token.encode(), f"spice-engine-channel/{role}".encode(), hashlib.sha256).digest())
    return zmq.curve_public(secret), secret


def curve_socket_class(token: str):
    """A zmq.Socket whose TCP binds are CURVE servers and TCP connects CURVE clients of `token`'s keys."""
    import zmq

    server_public, server_secret = _keypair(token, "server")
    client_public, client_secret = _keypair(token, "client")

    class CurveSocket(zmq.Socket):
        def bind(self, addr: str):
            if str(addr).startswith("tcp://"):
                self.curve_secretkey, self.curve_publickey = server_secret, server_public
                self.curve_server = True
            return super().bind(addr)

        def connect(self, addr: str):
            if str(addr).startswith("tcp://"):
                self.curve_serverkey = server_public
                self.curve_secretkey, self.curve_publickey = client_secret, client_public
            return super().connect(addr)

    return CurveSocket


def encrypt_engine_channels() -> None:
    """The vLLM general plugin: vLLM's message-queue module makes its ZeroMQ contexts with sockets
    that speak CURVE over TCP, in a process of the job's engines (the token in its environment)."""
    global _PATCHED
    from spice_megatron.wire.auth import TOKEN_ENV

    token = os.environ.get(TOKEN_ENV, "")
    if _PATCHED or not token:
        return
    import zmq
    from vllm.distributed.device_communicators import shm_broadcast

    class CurveContext(zmq.Context):
        _socket_class = curve_socket_class(token)

    shm_broadcast.Context = CurveContext
    _PATCHED = True
