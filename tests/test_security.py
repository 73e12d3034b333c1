"""Security on a shared cluster (docs/cluster.md, "Security on a shared cluster"): each attack it
protects against, played here and refused. A squatter on an engine's port, a stranger in the
weight-sync group, a planted checkpoint or counter file and hostile launcher values are each
refused before anything is sent, loaded or run."""
from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests
from dist_utils import free_port, run_ranks

from spice_megatron.wire.auth import TOKEN_ENV, AuthError, attest, read_token, signed_request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKEN = "job-secret-token"


@pytest.fixture(autouse=True)
def keep_umask():  # prepare_run_dir sets the run's umask in the calling process
    old = os.umask(0o022)
    os.umask(old)
    yield
    os.umask(old)


# ----------------------------------------------------------------------------- engines

class Squatter(BaseHTTPRequestHandler):
    """Another user's process on an engine's port: answers like an engine, records what reaches it."""

    seen: list = []

    def log_message(self, *a):
        pass

    def _send(self, obj):
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self.seen.append(("GET", self.path, self.headers.get("Authorization")))
        self._send({"status": "ok", "proof": "0" * 64, "version": 0, "workers": 1, "weight_transfer": "spice"})

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.seen.append(("POST", self.path, self.headers.get("Authorization"), body))
        self._send({"version": 0, "completions": [[{"text": "ATTACKER TEXT", "token_ids": [1], "logprobs": [-0.1],
                                                    "finish_reason": "stop", "versions": [[0, 0, 1]]}]]})


def test_a_squatter_on_an_engines_port_is_refused_before_it_sees_a_prompt_or_the_token(tmp_path):
    from spice_megatron.rollout.fleet import FleetError, RolloutFleet
    from spice_megatron.rollout.local import LocalEngine, wait_healthy
    from spice_megatron.wire.types import SamplingSpec

    port = free_port()
    server = ThreadingHTTPServer(("127.0.0.1", port), Squatter)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    loading = subprocess.Popen(["sleep", "30"])  # our engine, still starting
    Squatter.seen = []
    try:
        engine = LocalEngine(f"http://127.0.0.1:{port}", loading, os.devnull, [], token=TOKEN)
        with pytest.raises(RuntimeError, match="could not prove it holds this job's token"):
            wait_healthy([engine], timeout=2)
        fleet = RolloutFleet([engine.url], TOKEN)
        try:
            assert fleet.health() == {engine.url: None}
            with pytest.raises(FleetError):
                fleet.generate(["<challenger prompt with a corpus document>"], SamplingSpec(n=2))
        finally:
            fleet.close()
        with pytest.raises(AuthError, match="not our engine"):
            attest(engine.url, TOKEN)
    finally:
        loading.kill()
        loading.wait()
        server.shutdown()
        server.server_close()
    assert Squatter.seen and all(s[0] == "GET" and s[1].startswith("/attest?nonce=") for s in Squatter.seen)
    assert TOKEN not in repr(Squatter.seen) and all(s[2] is None for s in Squatter.seen)


def test_the_engine_holds_its_port_before_the_model_loads(monkeypatch, tmp_path):
    """serve.main binds first: while the (stand-in) engine loads, no one else can bind the port."""
    from spice_megatron.rollout import engine as engine_module
    from spice_megatron.rollout import serve

    port, seen = free_port(), {}

    class Loading:
        def __init__(self, *args, **kwargs):
            for reuse in (False, True):  # with SO_REUSEADDR a bound, not listening port was free
                s = socket.socket()
                if reuse:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind(("127.0.0.1", port))
                    seen[reuse] = "free"
                except OSError as e:
                    seen[reuse] = e.strerror
                finally:
                    s.close()
            seen["token"] = os.environ.get("SPICE_ROLLOUT_TOKEN")  # what vLLM's side of the sync reads
            raise RuntimeError("stand-in engine: stop here")

    monkeypatch.setattr(engine_module, "VLLMEngine", Loading)
    monkeypatch.setenv("SPICE_ROLLOUT_TOKEN", TOKEN)
    with pytest.raises(RuntimeError, match="stand-in engine"):
        serve.main(["--model", str(tmp_path), "--port", str(port)])
    assert seen == {False: "Address already in use", True: "Address already in use", "token": TOKEN}
    # an engine given --token-file hands the token to vLLM's side too
    token_file = tmp_path / "token"
    token_file.write_text("from-the-file\n")
    token_file.chmod(0o600)
    monkeypatch.delenv("SPICE_ROLLOUT_TOKEN")
    with pytest.raises(RuntimeError, match="stand-in engine"):
        serve.main(["--model", str(tmp_path), "--port", str(free_port()), "--token-file", str(token_file)])
    assert seen["token"] == "from-the-file"


def test_an_engine_without_the_job_token_receives_no_weights(monkeypatch):
    """The engine's receive fails closed."""
    from spice_megatron.bridge.sync_integrity import WeightSyncError
    from spice_megatron.rollout.engine_transfer import SpiceUpdateInfo, SpiceWeightTransferEngine

    monkeypatch.delenv("SPICE_ROLLOUT_TOKEN", raising=False)
    monkeypatch.delenv("SPICE_ROLLOUT_TOKEN_FILE", raising=False)
    receiver = object.__new__(SpiceWeightTransferEngine)
    receiver.group = object()
    with pytest.raises(WeightSyncError, match="holds no job token.*refused, unsigned weights"):
        receiver.receive_weights(SpiceUpdateInfo(version=1))


class StubEngine:
    """What build_app calls of a VLLMEngine (no vLLM): generation answers at once."""

    version, model_dir, workers, weight_transfer, quantization = "3", "/lustre/proj/secret_model_path", 1, "spice", None
    paused = updating = False
    steps = admissions = sleeps = wakes = requests_while_asleep = running = 0
    sleeping: set = set()

    def submit(self, requests_):
        from concurrent.futures import Future

        from spice_megatron.wire.types import Completion

        f = Future()
        f.set_result([[[Completion("hi", [1], [-0.1], "stop")] * spec.n for _ in prompts] for prompts,
                      spec in requests_])
        return f

    def call(self, fn, *args):
        from concurrent.futures import Future

        f = Future()
        f.set_result({} if fn.__name__ in ("sleep", "wake_up", "weight_checksums") else None)
        return f

    def __getattr__(self, name):  # the control methods, called through `call`
        def method(*args):
            return None

        method.__name__ = name
        return method


def _serve_stub(port: int, limits=None, engine=None):
    """A real build_app with the stub engine (or `engine`) on `port`, in a thread: (server, thread, url, app)."""
    import uvicorn

    from spice_megatron.rollout.serve import RequestLimits, build_app

    app = build_app(engine or StubEngine(), TOKEN, port, limits or RequestLimits())
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            requests.get(url + "/health", timeout=1)
            break
        except requests.RequestException:
            time.sleep(0.05)
    return server, thread, url, app


@pytest.fixture(scope="module")
def stub_service():
    from spice_megatron.rollout.serve import RequestLimits

    server, thread, url, app = _serve_stub(free_port(), RequestLimits(max_n=8, max_prompts=4, max_body_bytes=4096))
    yield app, url
    server.should_exit = True
    thread.join(10)


def test_every_route_but_health_and_attest_needs_a_signed_request_and_says_nothing_otherwise(stub_service):
    app, url = stub_service
    assert requests.get(url + "/health").json() == {"status": "ok"}  # no model path, version or counters
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert requests.get(url + path).status_code in (401, 404)  # unsigned: refused before any route
    routes = sorted({(m, r.path) for r in app.routes for m in getattr(r, "methods", ())} - {("GET", "/health"),
                                                                                           ("GET", "/attest")})
    assert ("POST", "/generate") in routes and ("GET", "/status") in routes and len(routes) >= 14
    for method, path in routes:
        if path == "/shutdown":
            continue  # a signed one would end this process
        body = {"prompts": ["x"], "sampling": {}} if path == "/generate" else None
        assert requests.request(method, url + path, json=body).status_code == 401, path
        assert requests.request(method, url + path, json=body,
                                headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 401, path
        with pytest.raises(AuthError, match="could not prove"):  # the engine's proof is for the job's token
            signed_request(method, url, path, "not-the-token", body)
        assert signed_request(method, url, path, TOKEN, body).status_code != 401, path
    assert signed_request("GET", url, "/status", TOKEN).json()["model"] == StubEngine.model_dir
    # a recorded request cannot be sent again
    from spice_megatron.wire.auth import sign_request

    header = {"Authorization": sign_request(TOKEN, "GET", "/status", instance=attest(url, TOKEN))}
    assert requests.get(url + "/status", headers=header).status_code == 200
    r = requests.get(url + "/status", headers=header)
    assert r.status_code == 401 and "replayed" in r.text


class Relay(BaseHTTPRequestHandler):
    """A squatter on engine A's port forwards every request
    (the attestation's nonce, signed requests) to sibling engine B of the same job, answering with
    B's answers; on POST /generate it answers with its own text."""

    sibling = ""

    def log_message(self, *a):
        pass

    def _relay(self, method):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))
        headers = {k: v for k, v in self.headers.items() if k.lower() in ("authorization", "content-type")}
        r = requests.request(method, self.sibling + self.path, data=body or None, headers=headers, timeout=10)
        content = r.content
        if self.path == "/generate" and r.ok:
            content = json.dumps({"version": 0, "completions": [[{"text": "ATTACKER TEXT", "token_ids": [1],
                                  "logprobs": [-0.1], "finish_reason": "stop", "versions": [[0, 0, 1]]}]]}).encode()
        self.send_response(r.status_code)
        for k, v in r.headers.items():
            if k.lower() not in ("content-length", "transfer-encoding", "connection", "date", "server"):
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(content)))
        self.end_headers()
        self.wfile.write(content)

    def do_GET(self):
        self._relay("GET")

    def do_POST(self):
        self._relay("POST")


def test_a_squatter_relaying_to_a_sibling_engine_proves_nothing_and_signed_requests_bind_one_engine():
    """The proof names the engine's own port and process, so a
    relayed proof is refused; a signed request is good at one engine process only (not a sibling,
    not a restarted engine on the same port, not with another query string), and an answer that
    the asked engine did not sign is refused."""
    from spice_megatron.wire.auth import sign_request

    (b_server, b_thread, b_url, _), (c_server, c_thread, c_url, _) = _serve_stub(free_port()), _serve_stub(free_port())
    port = free_port()
    Relay.sibling = b_url
    relay = ThreadingHTTPServer(("127.0.0.1", port), Relay)
    threading.Thread(target=relay.serve_forever, daemon=True).start()
    a_url = f"http://127.0.0.1:{port}"
    try:
        with pytest.raises(AuthError, match="could not prove it holds this job's token"):
            attest(a_url, TOKEN)  # B's proof names B's port
        # a request signed for B, sent to its sibling C, or with a query string added: refused
        b_instance = attest(b_url, TOKEN)
        header = {"Authorization": sign_request(TOKEN, "GET", "/status", instance=b_instance)}
        assert requests.get(c_url + "/status", headers=header).status_code == 401
        header = {"Authorization": sign_request(TOKEN, "POST", "/pause", instance=b_instance)}
        assert requests.post(b_url + "/pause?mode=other", headers=header).status_code == 401
        # B's signed answer is bound to the request's nonce: replaying B's answer to another request
        # (what a relay that answers for itself would do) is refused by the client
        from spice_megatron.wire import auth

        auth._instances[a_url] = b_instance  # the squatter somehow known as trusted: its answers still fail
        with pytest.raises(AuthError, match="not signed by the engine that was asked"):
            signed_request("POST", a_url, "/generate", TOKEN, {"prompts": ["<a corpus document>"]})
        auth._instances.pop(a_url, None)
        # B restarted on its port: a new process, a new instance; the old one's requests are refused
        b_port = int(b_url.rsplit(":", 1)[1])
        b_server.should_exit = True
        b_thread.join(10)
        b_server, b_thread, _, _ = _serve_stub(b_port)
        assert attest(b_url, TOKEN) != b_instance
        header = {"Authorization": sign_request(TOKEN, "GET", "/status", instance=b_instance)}
        assert requests.get(b_url + "/status", headers=header).status_code == 401
        assert signed_request("GET", b_url, "/status", TOKEN).status_code == 200
    finally:
        relay.shutdown()
        relay.server_close()
        for server, thread in ((b_server, b_thread), (c_server, c_thread)):
            server.should_exit = True
            thread.join(10)


def test_local_engines_are_trusted_only_as_the_process_that_was_started(stub_service):
    """`wait_healthy` compares the engine's signed pid with its child's."""
    from spice_megatron.rollout.local import LocalEngine, wait_healthy

    _, url = stub_service
    other = subprocess.Popen(["sleep", "30"])  # the process this run started (the stub answers for itself)
    try:
        with pytest.raises(RuntimeError, match=f"is process {os.getpid()}, not the one started there"):
            wait_healthy([LocalEngine(url, other, os.devnull, [], token=TOKEN)], timeout=2)
    finally:
        other.kill()
        other.wait()


def test_bodies_are_capped_on_every_method_and_unsigned_ones_never_parsed(stub_service):
    """A GET with a body, chunked or not, is refused
    before it is read; an unsigned POST is refused before FastAPI parses it."""
    _, url = stub_service
    r = requests.get(url + "/status", data=b"x" * (64 << 10))
    assert r.status_code == 413 and "takes no request body" in r.text

    def chunked():
        yield b"x" * 1024

    assert requests.get(url + "/weight_info", data=chunked()).status_code == 413
    assert requests.get(url + "/attest", params={"nonce": "n" * 16}, data=b"x" * 10).status_code == 413
    r = requests.post(url + "/generate", data=b"{" * 4000, headers={"Content-Type": "application/json"})
    assert r.status_code == 401 and "unsigned" in r.text  # refused on its header: the body was not even read


def test_generate_refuses_what_is_over_its_limits_and_keeps_serving(stub_service):
    _, url = stub_service
    r = signed_request("POST", url, "/generate", TOKEN, {"prompts": ["x"], "sampling": {"n": 9}})
    assert r.status_code == 413 and "n <= 8" in r.json()["detail"]
    r = signed_request("POST", url, "/generate", TOKEN, {"prompts": ["x"] * 5})
    assert r.status_code == 413 and "at most 4 prompts" in r.json()["detail"]
    r = signed_request("POST", url, "/generate", TOKEN, {"prompts": ["x" * 5000]})
    assert r.status_code == 413 and "over 4096 bytes" in r.json()["detail"]

    def chunked():
        yield b'{"prompts": ["x"]}'

    r = requests.post(url + "/generate", data=chunked())  # no Content-Length: refused before it is read
    assert r.status_code == 411
    r = signed_request("POST", url, "/generate", TOKEN, {"prompts": ["x", "y"], "sampling": {"n": 2}})
    assert r.status_code == 200 and [len(c) for c in r.json()["completions"]] == [2, 2]


def test_the_token_comes_from_the_environment_or_a_private_file_never_a_flag(tmp_path, monkeypatch):
    from spice_megatron.rollout import serve

    f = tmp_path / "token"
    f.write_text("from-file\n")
    f.chmod(0o644)
    with pytest.raises(AuthError, match="mode 644 lets others read it"):
        read_token(str(f))
    f.chmod(0o600)
    assert read_token(str(f)) == "from-file"
    monkeypatch.setenv("SPICE_ROLLOUT_TOKEN", "from-env")
    assert read_token() == "from-env"
    with pytest.raises(SystemExit):
        serve.main(["--model", str(tmp_path), "--token", "on-the-command-line"])
    monkeypatch.delenv("SPICE_ROLLOUT_TOKEN")
    assert serve.main(["--model", str(tmp_path)]) == 2


# ----------------------------------------------------------------------------- weight sync

def _sync_rank(port, sender_token, receiver_token):
    """Rank 0 sends three tensors signed with its key; rank 1 (an engine) receives with its own."""
    import torch

    from spice_megatron.bridge.sync_integrity import ReceivedManifest, WeightSyncError, compare_checksums
    from spice_megatron.bridge.weight_receive import receive_all
    from spice_megatron.bridge.weight_sync import BucketSender, WeightSyncGroup
    from spice_megatron.wire.auth import sync_key

    rank = int(os.environ["RANK"])
    nonce = "a-nonce-the-trainer-sent-over-http"
    group = WeightSyncGroup("127.0.0.1", port, rank, 1, 1, "gloo", timeout_s=60)
    tensors = {f"model.layers.{i}.w": torch.full((64, 64), float(i)) for i in range(3)}
    try:
        if rank == 0:
            sender = BucketSender(group, 7, bucket_bytes=40_000, key=sync_key(sender_token,
                                                                              nonce) if sender_token else None)
            for name, t in tensors.items():
                (slot,) = sender.reserve([(name, tuple(t.shape), t.dtype)])
                slot.copy_(t)
            try:
                return sender.close().buckets
            except Exception as e:  # noqa: BLE001 - the receiver left
                return f"sender: {type(e).__name__}"
        manifest, loaded = ReceivedManifest(), {}
        try:
            for bucket in receive_all(group, manifest, key=sync_key(receiver_token, nonce) if receiver_token else None):
                loaded.update({n: t.clone() for n, t in bucket})
            compare_checksums(manifest.received, manifest)
        except WeightSyncError as e:
            return f"refused: {e}", sorted(loaded)
        return "loaded", sorted(loaded)
    finally:
        group.close()


@pytest.mark.multiprocess
@pytest.mark.parametrize("stranger", [None, "a-stranger-without-the-token"])
def test_a_stranger_in_the_sync_group_cannot_make_an_engine_load_weights(stranger, tmp_path):
    """Whoever reaches the rendezvous store can join the group as the stage's sender; buckets not
    signed with this sync's key are refused before the engine loads any of them."""
    sender, (outcome, loaded) = run_ranks(_sync_rank, 2, free_port(), stranger, TOKEN, tmp_path=tmp_path, timeout=120)
    if stranger is None:  # no key at all: it takes every member, its unsigned buckets are refused
        assert outcome.startswith("refused:") and "not signed with this sync's key" in outcome and "bucket 0" in outcome
    else:  # another key: it cannot check the engine's membership proof, and the engine learns so
        assert outcome.startswith("refused:") and "refused this sync's members" in outcome
    assert loaded == [] and str(sender).startswith("sender:")
    sender, (outcome, loaded) = run_ranks(_sync_rank, 2, free_port(), TOKEN, TOKEN, tmp_path=tmp_path, timeout=120)
    assert outcome == "loaded" and len(loaded) == 3 and sender >= 2


@pytest.mark.multiprocess
@pytest.mark.parametrize("stranger", [None, "a-stranger-without-the-token"])
def test_a_stranger_in_an_engines_sync_rank_receives_no_weights(stranger, tmp_path):
    """A process that takes an engine's sync rank
    without the token fails the membership round before the first bucket: the sender sends nothing
    and says so, instead of reporting the sync done."""
    sender, (outcome, loaded) = run_ranks(_sync_rank, 2, free_port(), TOKEN, stranger, tmp_path=tmp_path, timeout=120)
    assert str(sender).startswith("sender: WeightSyncError") and loaded == []
    assert outcome.startswith("refused:") and "refused this sync's members" in outcome


def test_a_tensor_rewritten_in_flight_no_longer_keeps_its_checksum():
    """The unkeyed checksum is linear with public
    coefficients (words 251 apart weigh the same), so a rewrite can keep it; the sync's checksum is
    keyed with the sync's key and catches the same rewrite."""
    import torch

    from spice_megatron.bridge.sync_integrity import tensor_checksum
    from spice_megatron.wire.auth import sync_key

    key = sync_key(TOKEN, "a-sync-nonce")
    t = torch.randn(8192)
    forged = t.clone()
    forged[3], forged[254] = t[254], t[3]  # a rewrite the public coefficients cannot see
    assert not torch.equal(t, forged) and tensor_checksum(forged) == tensor_checksum(t)
    assert tensor_checksum(forged, key) != tensor_checksum(t, key)
    assert tensor_checksum(t, key) == tensor_checksum(t.clone(), key)  # deterministic
    assert tensor_checksum(t, key) != tensor_checksum(t, sync_key(TOKEN, "another-nonce"))  # per sync


def _capped_receiver_rank(port):
    """Rank 0 sends a 16 KiB tensor; rank 1 takes buckets of at most 4 KiB (the trainer's figure)."""
    import torch

    from spice_megatron.bridge.sync_integrity import WeightSyncError
    from spice_megatron.bridge.weight_receive import receive_all
    from spice_megatron.bridge.weight_sync import BucketSender, WeightSyncGroup

    rank = int(os.environ["RANK"])
    group = WeightSyncGroup("127.0.0.1", port, rank, 1, 1, "gloo", timeout_s=30)
    try:
        if rank == 0:
            sender = BucketSender(group, 1, bucket_bytes=1 << 20)
            sender.reserve([("w", (4096,), torch.float32)])[0].fill_(1.0)
            try:
                return sender.close().buckets
            except Exception as e:  # noqa: BLE001 - the receiver left
                return type(e).__name__
        try:
            return [n for bucket in receive_all(group, max_bytes=4096) for n, _ in bucket]
        except WeightSyncError as e:
            return str(e)
    finally:
        group.close()


@pytest.mark.multiprocess
def test_unsigned_sizes_are_capped_before_the_engine_allocates(tmp_path):
    """A bucket's size comes from unsigned metadata; the engine caps
    it by the trainer's largest bucket (sent over the signed HTTP plane) before allocating."""
    _, refused = run_ranks(_capped_receiver_rank, 2, free_port(), tmp_path=tmp_path, timeout=120)
    assert "a bucket of 16384 bytes announced, this engine takes at most 4096: refused before allocating" in refused


def test_the_sync_store_listens_on_the_engines_address_only():
    from spice_megatron.bridge.weight_sync import WeightSyncGroup

    port, errors = free_port(), []

    def master():  # waits for a receiver that never comes
        try:
            WeightSyncGroup("127.0.0.1", port, 0, 1, 1, "gloo", timeout_s=4)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=master, daemon=True)
    t.start()
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), 1).close()
            break
        except OSError:
            time.sleep(0.05)
    with pytest.raises(ConnectionRefusedError):  # TCPStore alone listens on every interface
        socket.create_connection(("127.0.0.2", port), 1)
    t.join(30)


# ----------------------------------------------------------------------------- run directory

def _planted_run_dir(root) -> tuple[str, str]:
    """ckpt_probe.py: a checkpoint whose .metadata runs a command when unpickled, with a manifest
    that matches (a writer of the run directory recomputes CRC-32s)."""
    import zlib

    run = os.path.join(root, "run")
    step = os.path.join(run, "checkpoints", "step_00000004")
    os.makedirs(step)
    payload = os.path.join(root, "PWNED_BY_METADATA")

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {payload}",))

    with open(os.path.join(step, ".metadata"), "wb") as f:
        f.write(pickle.dumps(Evil()))
    with open(os.path.join(step, "layout.json"), "w") as f:
        json.dump({"tp": 1, "pp": 1, "dp": 1, "step": 4}, f)
    files = {n: {"size": os.path.getsize(os.path.join(step, n)),
                 "crc32": zlib.crc32(open(os.path.join(step, n), "rb").read())} for n in os.listdir(step)}
    with open(os.path.join(step, "manifest.json"), "w") as f:
        json.dump({"files": files}, f)
    with open(os.path.join(run, "checkpoints", "latest"), "w") as f:
        f.write("step_00000004\n")
    return run, payload


@pytest.mark.parametrize("how", ["run directory writable by its group", "checkpoint file writable by others",
                                 "checkpoint owned by another user"])
def test_a_planted_checkpoint_is_refused_before_anything_loads(how, tmp_path):
    from spice_megatron.run_dir import UnsafeRunDir, prepare_run_dir

    run, payload = _planted_run_dir(str(tmp_path))
    metadata = os.path.join(run, "checkpoints", "step_00000004", ".metadata")
    if how.startswith("run directory"):
        os.chmod(run, 0o775)
        match = "writable by its group"
    elif how.startswith("checkpoint file"):
        os.chmod(metadata, 0o666)
        match = r"checkpoint .*\.metadata is writable by its group and others"
    else:
        if os.geteuid() != 0:
            pytest.skip("needs root to give a file to another user")
        os.chown(metadata, 65534, 65534)
        match = "is owned by"
    with pytest.raises(UnsafeRunDir, match=match):
        prepare_run_dir(run)
    assert not os.path.exists(payload)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a directory another user's")
def test_a_run_directory_under_another_users_parent_is_refused_and_checked_again_before_a_load(tmp_path):
    """In a sticky shared scratch another user made
    `scratch/alice` before the user's first run; whatever is under it can be swapped after the
    checks. The run directory, and a checkpoint right before it loads, are refused."""
    from spice_megatron.policy.checkpoint_files import latest_checkpoint
    from spice_megatron.run_dir import UnsafeRunDir, check_checkpoint_tree, prepare_run_dir

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    os.chmod(scratch, 0o1777)
    theirs = scratch / "alice"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    with pytest.raises(UnsafeRunDir, match=f"the directory above it, {theirs}, is owned by"):
        prepare_run_dir(str(theirs / "qwen3_8b"))
    mine = scratch / "mine"  # the user's own directory in the sticky scratch: fine
    prepare_run_dir(str(mine / "run"))
    run, payload = _planted_run_dir(str(mine / "run2"))
    os.chmod(mine, 0o777)  # a parent anyone may write: the checkpoint could be swapped before its load
    with pytest.raises(UnsafeRunDir, match="writable by others .*not sticky"):
        check_checkpoint_tree(os.path.join(run, "checkpoints", "step_00000004"))
    os.chmod(mine, 0o755)
    # `latest` never leads out of the tree
    with open(os.path.join(run, "checkpoints", "latest"), "w") as f:
        f.write(str(tmp_path))
    assert latest_checkpoint(os.path.join(run, "checkpoints")) != str(tmp_path)
    with open(os.path.join(run, "checkpoints", "latest"), "w") as f:
        f.write("../../..")
    assert latest_checkpoint(os.path.join(run, "checkpoints")) == os.path.join(run, "checkpoints", "step_00000004")
    assert not os.path.exists(payload)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give files to another user")
def test_the_job_script_refuses_code_or_a_run_directory_another_user_controls(tmp_path):
    """Another user's copy of spice_megatron/ (mode
    644) passed the job's code check, and an OUTPUT_DIR under another user's directory started."""
    import shutil

    from test_slurm import STAND_IN, _run_job

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("srun", "scontrol", "curl", "python", "squeue"):
        (bin_dir / name).write_text(STAND_IN.format(python=sys.executable))
        (bin_dir / name).chmod(0o755)
    home = tmp_path / "home"
    for part in ("spice_megatron", "recipes", "slurm"):
        shutil.copytree(os.path.join(ROOT, part), home / part, ignore=shutil.ignore_patterns("__pycache__"))
    os.chown(home / "spice_megatron" / "cli" / "__init__.py", 65534, 65534)
    script = str(home / "slurm" / "spice_8b.sbatch")
    r, calls, _, _ = _run_job(script, bin_dir, tmp_path, SPICE_HOME=str(home))
    assert r.returncode == 2 and "cli/__init__.py is another user's" in r.stderr, r.stderr
    assert not any(c["cmd"] == "srun" for c in calls)
    os.chown(home / "spice_megatron" / "cli" / "__init__.py", 0, 0)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    r, _, _, _ = _run_job(script, bin_dir, tmp_path, SPICE_HOME=str(home), OUTPUT_DIR=str(theirs / "run"))
    assert r.returncode == 2 and f"lies under {theirs} (owned by" in r.stderr, r.stderr


def test_spice_train_refuses_an_unsafe_run_directory_with_one_line(tmp_path):
    run, payload = _planted_run_dir(str(tmp_path))
    os.chmod(run, 0o777)
    r = subprocess.run([sys.executable, "-m", "spice_megatron.cli", "train", "--recipe", "tiny_cpu", "--output-dir",
                        run, "--resume"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(f"error: run directory {run} is writable by its group "
                                                        "and others (mode 777)")
    assert not os.path.exists(payload)


def test_a_new_run_directory_is_private(tmp_path):
    from spice_megatron.run_dir import prepare_run_dir

    old = os.umask(0o022)
    try:
        prepare_run_dir(str(tmp_path / "private"))
        prepare_run_dir(str(tmp_path / "shared"), group_readable=True)
        assert os.umask(0o022) == 0o027  # what every rank writes under
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "private").st_mode & 0o777 == 0o700
    assert os.stat(tmp_path / "shared").st_mode & 0o777 == 0o750


def test_the_job_script_refuses_a_counter_file_that_is_not_a_count(tmp_path):
    from test_slurm import SBATCH, STAND_IN, _run_job

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("srun", "scontrol", "curl", "python", "squeue"):
        (bin_dir / name).write_text(STAND_IN.format(python=sys.executable))
        (bin_dir / name).chmod(0o755)
    (tmp_path / "run").mkdir()
    payload = tmp_path / "PWNED_BY_COUNTER"
    (tmp_path / "run" / ".slurm_failed_attempts").write_text(f"RESTART[$(touch {payload})0]\n")
    script = next(s for s in SBATCH if s.endswith("spice_8b.sbatch"))
    r, calls, _, _ = _run_job(script, bin_dir, tmp_path, learner="fail")
    assert r.returncode == 2 and "not a count" in r.stderr, r.stderr
    assert not payload.exists() and not any(c["cmd"] == "srun" for c in calls)
    # numbers from the environment are checked before any arithmetic sees them
    r, _, _, _ = _run_job(script, bin_dir, tmp_path, MAX_RESTARTS=f"x[$(touch {payload})]")
    assert r.returncode == 2 and "MAX_RESTARTS=" in r.stderr and "not a whole number" in r.stderr
    assert not payload.exists()
    os.chmod(tmp_path / "run", 0o777)
    (tmp_path / "run" / ".slurm_failed_attempts").write_text("1\n")
    r, _, _, _ = _run_job(script, bin_dir, tmp_path)
    assert r.returncode == 2 and "is not yours alone to write" in r.stderr


STORE_PROBE = """
import os, socket, sys
import torch.distributed as dist
dist.init_process_group("gloo")  # the world forms through the agent's store
port = int(os.environ["MASTER_PORT"])
listening = []
for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    for line in open(table).read().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
            listening.append(local.rsplit(":", 1)[0])
if dist.get_rank() == 0:
    print("LISTENING", sorted(set(listening)), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.multiprocess
def test_the_learners_rendezvous_store_listens_on_loopback_only(tmp_path):
    """torchrun's store, which `spice train`
    starts for its local ranks, listened on every interface; it is bound to 127.0.0.1 now (the
    c10d rendezvous of a multi-node job to the head node's address)."""
    from spice_megatron.torchrun import free_port

    script = tmp_path / "probe.py"
    script.write_text(STORE_PROBE)
    port = free_port()
    r = subprocess.run([sys.executable, "-m", "spice_megatron.torchrun", "--nproc_per_node=2",
                        "--master_addr=127.0.0.1",
                        f"--master_port={port}", str(script)], capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    listening = next(line for line in r.stdout.splitlines() if line.startswith("LISTENING"))
    assert listening == "LISTENING ['0100007F']", listening  # 127.0.0.1, not 00000000 (every interface)


def _world_member(secrets_by_rank):
    """One rank of a 2-rank learner world whose ranks hold the given secrets."""
    from spice_megatron.config import ParallelConfig
    from spice_megatron.policy.parallel import init_distributed

    os.environ["SPICE_WORLD_SECRET"] = secrets_by_rank[int(os.environ["RANK"])]
    try:
        init_distributed(ParallelConfig())
        return "joined"
    except RuntimeError as e:
        return str(e)


@pytest.mark.multiprocess
def test_a_process_in_a_learner_ranks_place_is_refused_before_any_object_is_exchanged(tmp_path):
    """Ranks unpickle each other's objects; a process that took a
    rank's place through the store (no secret of the job's) stops the world before any of that."""
    assert run_ranks(_world_member, 2, ["job-secret", "job-secret"], tmp_path=tmp_path) == ["joined", "joined"]
    refused = run_ranks(_world_member, 2, ["job-secret", "a-stranger's-guess"], tmp_path=tmp_path)
    assert "learner rank(s) [1] could not prove they hold this job's secret" in refused[0], refused
    assert "could not prove" in refused[1]  # the stranger learns nothing but that it was refused


# ----------------------------------------------------------------------------- launchers

def test_the_nemo_run_script_keeps_hostile_values_inert(tmp_path, monkeypatch):
    """dry.py: hostile paths and overrides in the generated sbatch script are data, not code."""
    import io

    pytest.importorskip("nemo_run")
    monkeypatch.setenv("NEMORUN_HOME", str(tmp_path / "nemorun"))
    monkeypatch.setattr("sys.stdin", io.StringIO(""))  # NeMo-Run's local tunnel (invoke) reads stdin
    from spice_megatron.cli.nemo_launcher import dryrun_sbatch, slurm_experiment

    model = f"/models/Q8B$(touch {tmp_path}/pwned1)"
    output = f"/results/q8;touch${{IFS}}{tmp_path}/pwned2"
    overrides = ["run.iterations=3", f"run.name=ab$(touch {tmp_path}/pwned3)"]
    text = dryrun_sbatch(slurm_experiment("qwen3_8b", account="acct", partition="p", container_image="none",
                                          model_dir=model, data_dir="/data", output_dir=output, overrides=overrides,
                                          job_dir=str(tmp_path / "nemorun")))
    exports = "\n".join(line for line in text.splitlines() if line.startswith("export SPICE_MODEL=")
                        or line.startswith("export SPICE_LOG_DIR="))
    train = next(line for line in text.splitlines() if "spice_megatron/cli/__main__.py train" in line)
    args = train.split("spice_megatron/cli/__main__.py ", 1)[1].rsplit(" & pids", 1)[0]
    r = subprocess.run(["bash", "-c",
                        exports + '\nprintf "%s\\n" "$SPICE_MODEL" "$SPICE_LOG_DIR"\nprintf "%s\\n" ' + args],
                       capture_output=True, text=True, cwd=tmp_path, timeout=30)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [model, f"{output}/logs", "train", "--recipe", "qwen3_8b", "--model", model,
                                     "--output", output, "--resume", *overrides]
    assert not list(tmp_path.glob("pwned*"))
    with pytest.raises(ValueError, match="--mount .* unquoted"):
        slurm_experiment("qwen3_8b", account="acct", partition="p", container_image="/images/x.sqsh",
                         model_dir="/models/m", data_dir="/data", output_dir="/results/r",
                         mounts=["/lustre:/models;id"], job_dir=str(tmp_path / "nemorun"))


def test_a_request_posted_again_under_its_id_gets_the_first_posts_answer_without_a_second_run():
    """The fleet posts a request again under its id when its read timed out on a working engine
    (rollout/fleet.py): the engine runs it once; an id's answer, once taken, is not kept."""
    from concurrent.futures import Future

    class CountingEngine(StubEngine):
        submitted = 0
        answer: Future | None = None

        def submit(self, requests_):
            type(self).submitted += 1
            type(self).answer = super().submit(requests_)
            if self.submitted == 1:  # the first run is slow: its answer comes after the client gave up
                slow = Future()
                threading.Timer(1.5, lambda: slow.set_result(self.answer.result())).start()
                return slow
            return self.answer

    server, thread, url, _ = _serve_stub(free_port(), engine=CountingEngine())
    try:
        body = {"prompts": ["a", "b"], "sampling": {"n": 2, "max_tokens": 4}, "request_id": "r" * 32}
        with pytest.raises(requests.ReadTimeout):
            signed_request("POST", url, "/generate", TOKEN, body, 0.5)
        first = signed_request("POST", url, "/generate", TOKEN, body).json()  # posted again: the same run
        assert CountingEngine.submitted == 1 and len(first["completions"]) == 2
        second = signed_request("POST", url, "/generate", TOKEN, body).json()  # taken: a new run
        assert CountingEngine.submitted == 2 and second["completions"] == first["completions"]
        assert signed_request("GET", url, "/status", TOKEN).json()["running"] == 0
    finally:
        server.should_exit = True
        thread.join(10)


WATCH_LEADER = r'''
import sys, time
from spice_megatron.rollout.node_watch import watch_followers
try:
    watch_followers("127.0.0.1", int(sys.argv[1]), 1, timeout_s=60, master_port=int(sys.argv[2]))
except OSError as e:
    print(f"leader: cannot open its watch: {e.strerror}", flush=True)
    sys.exit(1)
time.sleep(float(sys.argv[3]))
print("leader: alive", flush=True)
'''
WATCH_FOLLOWER = r'''
import sys, time
from spice_megatron.rollout.node_watch import hold_to_leader
try:
    print("follower: told", hold_to_leader("127.0.0.1", int(sys.argv[1]), 1, timeout_s=float(sys.argv[2])), flush=True)
except OSError as e:
    print(f"follower: gave up: {e}", flush=True)
    sys.exit(1)
time.sleep(60)  # a follower holds on for as long as it lives
'''


def _watch_py(code: str, *args: object, token: str = TOKEN) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], env={**os.environ, TOKEN_ENV: token},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.multiprocess
def test_the_follower_watch_counts_only_peers_that_prove_the_job_token_both_ways():
    """A squatter on an engine's follower watch and on vLLM's store port, played by a process without
    the token (the attack needs only the network,
    so no second user here). A: a stranger that connects first and hangs up ends nothing. B: one that
    holds a slot keeps the job's follower out of nothing. C: one that binds the watch port before the
    leader is not followed, and learns no store port. The store's port (M1's second squat) is told only
    to a follower that proved itself, and only after the leader proved itself to it."""
    import socket as socket_

    store = free_port()
    for mode in ("hangup", "hold"):
        watch = free_port()
        leader = _watch_py(WATCH_LEADER, watch, store, 6)
        deadline, stranger = time.monotonic() + 30, None
        while stranger is None and time.monotonic() < deadline:
            try:
                stranger = socket_.create_connection(("127.0.0.1", watch), timeout=1)
            except OSError:
                time.sleep(0.05)
        assert stranger is not None
        if mode == "hangup":
            stranger.close()
        follower = _watch_py(WATCH_FOLLOWER, watch, 30)
        assert follower.stdout.readline().strip() == f"follower: told {store}", mode
        out = leader.communicate(timeout=60)[0]
        assert "leader: alive" in out and "is gone" not in out, (mode, out)  # ended by nothing
        follower.kill()
        follower.wait(30)
        if mode == "hold":
            stranger.settimeout(15)  # the stranger was sent a nonce, proved nothing and was closed
            assert b"nonce" in stranger.recv(200) and stranger.recv(200) == b""
            stranger.close()
    # C. the watch port is another process's before the leader binds it: the follower does not follow it
    watch = free_port()
    squatter = socket_.create_server(("127.0.0.1", watch))
    follower = _watch_py(WATCH_FOLLOWER, watch, 4)
    conn, _ = squatter.accept()
    conn.sendall(b'{"nonce": "' + b"0" * 32 + b'"}\n')  # it plays the leader as far as it can
    assert conn.recv(1000)  # the follower's proof, of nothing the squatter can use
    conn.sendall(b'{"master_port": 4444, "proof": "forged"}\n')
    out = follower.communicate(timeout=60)[0]
    assert "gave up" in out and "did not prove it is this job's leader" in out and "told" not in out
    conn.close()
    squatter.close()
    # a follower holding another token is refused by the leader, and the leader ended by nothing
    watch = free_port()
    leader = _watch_py(WATCH_LEADER, watch, store, 8)
    follower = _watch_py(WATCH_FOLLOWER, watch, 5, token="not-the-job-token" * 2)
    assert "gave up" in follower.communicate(timeout=60)[0]
    out = leader.communicate(timeout=60)[0]
    assert "leader: alive" in out and "did not prove it holds the job's token" in out


@pytest.mark.multiprocess
def test_an_engine_across_nodes_starts_only_on_a_declared_trusted_network(tmp_path, monkeypatch):
    """vLLM's store and message queues are not authenticated (vLLM's security
    guide: an isolated network; vllm#29565): an engine across nodes starts only where the operator
    declared a network only the job reaches, one line and exit 2 otherwise, on every path."""
    env = {k: v for k, v in os.environ.items() if k != "SPICE_TRUSTED_NETWORK"}
    span = ["--model", str(tmp_path), "--tensor-parallel-size", "2", "--nnodes", "2", "--watch-port", "29999"]
    for module, extra in (("spice_megatron.rollout.serve", []), ("spice_megatron.rollout.follower", ["--node-rank",
                                                                                                    "1"])):
        r = subprocess.run([sys.executable, "-m", module, *span, *extra], env={**env, TOKEN_ENV: TOKEN},
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, (module, r.stderr)
        assert "error: --nnodes 2: an engine across nodes runs vLLM's store" in r.stderr
        assert "SPICE_TRUSTED_NETWORK=1" in r.stderr
    r = subprocess.run(["bash", os.path.join(ROOT, "slurm", "rollout_node.sh")], capture_output=True, text=True,
                       timeout=60, env={**env, "SPICE_MODEL": "/m", "SPICE_ROLLOUT_TOKEN": TOKEN,
                                        "SPICE_ENGINE_TP": "16", "SPICE_GPUS_PER_NODE": "8",
                                        "SPICE_ROLLOUT_NODES": "a,b", "SLURM_NODEID": "0",
                                        "SPICE_LOG_DIR": str(tmp_path / "logs")})
    assert r.returncode == 2 and "set SPICE_TRUSTED_NETWORK=1" in r.stderr
    import io

    from spice_megatron.cli.nemo_launcher import slurm_experiment

    monkeypatch.setenv("NEMORUN_HOME", str(tmp_path / "nemorun"))
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    with pytest.raises(ValueError, match="rollout.engine_tensor_parallel=16: an engine across nodes runs vLLM's"):
        slurm_experiment("qwen3_8b", account="acct", partition="p", container_image="none", model_dir="/m",
                         data_dir="/data", output_dir=str(tmp_path / "out"),
                         overrides=["rollout.engine_tensor_parallel=16", "cluster.nodes=4", "cluster.learner_nodes=2"],
                         env={"SPICE_TRUSTED_NETWORK": "0"})


def test_the_job_refuses_a_spice_home_others_can_write_or_a_file_of_anothers_in_it(tmp_path):
    """The job checked SPICE_HOME's ancestors and three
    subtrees, not SPICE_HOME itself; every node runs `python -m` from it, so another group member's
    SPICE_HOME/secrets.py ran as the job's user. Refused now: a SPICE_HOME writable by group or others,
    or anything directly in it that is another user's (the second case needs root to play that user)."""
    import shutil

    from test_slurm import STAND_IN, _job_env

    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    for name in ("srun", "scontrol", "curl", "python", "squeue"):
        (fake_bin / name).write_text(STAND_IN.format(python=sys.executable))
        (fake_bin / name).chmod(0o755)
    home = tmp_path / "proj" / "spice"
    home.mkdir(parents=True)
    os.chmod(tmp_path, 0o755)
    os.chmod(home.parent, 0o755)
    for d in ("spice_megatron", "recipes", "slurm"):
        shutil.copytree(os.path.join(ROOT, d), home / d, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(["chmod", "-R", "go-w", str(home)], check=True)
    out = tmp_path / "runs" / "mine"
    out.mkdir(parents=True, mode=0o700)
    script = str(home / "slurm" / "spice_8b.sbatch")

    def job() -> subprocess.CompletedProcess:
        run_dir = tmp_path / f"cwd{time.monotonic_ns()}"
        run_dir.mkdir()
        env, _, _ = _job_env(script, fake_bin, run_dir, SPICE_HOME=str(home), OUTPUT_DIR=str(out))
        return subprocess.run(["bash", script], env=env, cwd=run_dir, capture_output=True, text=True, timeout=100)

    os.chmod(home, 0o777)  # a group project directory (2775 on a cluster)
    r = job()
    assert r.returncode == 2 and f"spice: {home} is another user's or writable by group or others" in r.stderr
    os.chmod(home, 0o755)
    assert job().returncode == 0
    if os.geteuid() == 0:  # another user's module beside the code (written while the directory was open)
        (home / "secrets.py").write_text("import os\nos.system('touch RAN')\n")
        os.chown(home / "secrets.py", 65534, 65534)
        r = job()
        assert r.returncode == 2 and f"spice: {home}/secrets.py is another user's" in r.stderr


def test_a_rank_a_launcher_started_checks_the_run_directory_before_it_writes_the_config(tmp_path):
    """Rank 0 of a srun task wrote config.json.tmp through
    another user's link, into a private file of its user, before the run directory was refused."""
    os.chmod(tmp_path, 0o755)
    results = tmp_path / "results"
    results.mkdir()
    os.chmod(results, 0o777)  # a group's results area
    run = results / "run"
    run.mkdir()
    victim = tmp_path / "private_notes.txt"
    victim.write_text("mine\n")
    (run / "config.json.tmp").symlink_to(victim)
    env = {**os.environ, "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
    r = subprocess.run([sys.executable, "-m", "spice_megatron.cli", "train", "--resume", "--output", str(run)],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and f"run directory {run}: the directory above it, {results}, is writable" in r.stderr
    assert victim.read_text() == "mine\n" and not (run / "config.json").exists()


def test_a_link_on_the_way_to_a_run_directory_is_refused_unless_it_is_the_users_in_a_safe_place(tmp_path):
    """The checks resolved links first, so another user's
    link in a sticky scratch (flipped between the check and a load) was never checked."""
    from spice_megatron.run_dir import UnsafeRunDir, prepare_run_dir

    os.chmod(tmp_path, 0o755)
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    os.chmod(scratch, 0o1777)  # sticky, like /tmp
    (scratch / "my_link").symlink_to(mine)  # the user's own link in a sticky directory: fine
    prepare_run_dir(str(scratch / "my_link" / "run1"))
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)  # not sticky: anyone can replace the link
    (open_dir / "link").symlink_to(mine)
    with pytest.raises(UnsafeRunDir, match="a link in a directory others can write"):
        prepare_run_dir(str(open_dir / "link" / "run2"))
    if os.geteuid() == 0:  # another user's link in the sticky scratch
        (scratch / "alice").symlink_to(mine)
        os.lchown(scratch / "alice", 65534, 65534)
        with pytest.raises(UnsafeRunDir, match="a link owned by"):
            prepare_run_dir(str(scratch / "alice" / "run3"))


def test_only_an_engine_across_nodes_arms_the_parent_death_switch_of_its_workers():
    """SPICE_DIE_WITH_PARENT inherited from the submitting shell (sbatch exports
    it) armed the plugin in any vLLM process; `spice` and a single-node engine drop it, and a leader or
    follower sets it to its own pid."""
    code = ("import os\nfrom spice_megatron import cli\n"
            "try:\n    cli.main(['audit', '/nonexistent'])\nexcept SystemExit:\n    pass\n"
            "print('left:', os.environ.get('SPICE_DIE_WITH_PARENT'))\n")
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "SPICE_DIE_WITH_PARENT": "1"},
                       capture_output=True, text=True, timeout=120)
    assert "left: None" in r.stdout, r.stdout + r.stderr[-2000:]


def test_an_unsigned_body_is_refused_before_the_engine_reads_any_of_it(stub_service):
    """A well-formed header with a made-up MAC made the
    engine buffer its body (up to 64 MiB, ~69 MiB RSS per connection, 1,024 connections) before the MAC
    was checked. The header now signs the body's SHA-256: a forged one is answered 401 while the body is
    still unsent."""
    import hashlib

    from spice_megatron.wire.auth import SCHEME

    _, url = stub_service
    host, port = url.rsplit("/", 1)[1].split(":")
    body_size = 4000  # under the stub's 4096-byte cap: only the signature can refuse it
    forged = (f"{SCHEME} ts={time.time():.3f},nonce={'n' * 32},sha={hashlib.sha256(b'x').hexdigest()},"
              f"mac={'0' * 64}")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall((f"POST /generate HTTP/1.1\r\nHost: {host}\r\nAuthorization: {forged}\r\n"
                   f"Content-Type: application/json\r\nContent-Length: {body_size}\r\n\r\n").encode() + b"{")
        answer = s.recv(4096).decode()  # the other 3,999 bytes are never sent
    assert answer.startswith("HTTP/1.1 401") and "wrong signature" in answer
    # and a signed header whose body is not the one signed
    from spice_megatron.wire.auth import sign_request

    instance = attest(url, TOKEN)
    header = sign_request(TOKEN, "POST", "/generate", b'{"prompts": ["a"]}', instance)
    r = requests.post(url + "/generate", data=b'{"prompts": ["b"]}', headers={"Authorization": header,
                                                                          "Content-Type": "application/json"})
    assert r.status_code == 401 and "the body is not the one signed" in r.text


def test_an_engines_proof_names_its_address_so_a_relay_at_another_address_is_refused():
    """The attestation bound the engine's port, not its
    address; a process at the same port on another address relayed to a sibling engine, was trusted,
    and read every prompt. The proof now names the address the engine's socket is bound to, and the
    fleet refuses a proof for an address the URL it dialled does not name."""
    import uvicorn

    from spice_megatron.rollout.serve import build_app

    if not socket.has_ipv6:
        pytest.skip("no IPv6 loopback to stand for a second host")
    port = free_port()
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", port))
    except OSError:
        pytest.skip("no IPv6 loopback to stand for a second host")
    app = build_app(StubEngine(), TOKEN, port, host="::1")  # engine B, bound to [::1]:port
    server = uvicorn.Server(uvicorn.Config(app, host="::1", port=port, log_level="error"))
    threading.Thread(target=server.run, daemon=True).start()
    relay = socket.create_server(("127.0.0.1", port))  # another process at 127.0.0.1:port, relaying to B

    def pipe(a, b):
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            b.close()

    def relay_loop():
        while True:
            try:
                c, _ = relay.accept()
            except OSError:
                return
            upstream = socket.create_connection(("::1", port))
            threading.Thread(target=pipe, args=(c, upstream), daemon=True).start()
            threading.Thread(target=pipe, args=(upstream, c), daemon=True).start()

    threading.Thread(target=relay_loop, daemon=True).start()
    try:
        for _ in range(200):
            try:
                requests.get(f"http://[::1]:{port}/health", timeout=1)
                break
            except requests.RequestException:
                time.sleep(0.05)
        assert attest(f"http://[::1]:{port}", TOKEN)  # B itself, at its own address
        with pytest.raises(AuthError, match="proved it holds this job's token for ::1, an address 127.0.0.1 does not"):
            attest(f"http://127.0.0.1:{port}", TOKEN)
    finally:
        relay.close()
        server.should_exit = True


def test_an_engines_queues_across_nodes_are_read_only_with_the_job_token(monkeypatch):
    """vLLM's message queues between an engine's nodes (the broadcast of every
    step's prompts) bound unauthenticated on the node's address. With the plugin they speak CURVE with
    keys from the job token: the job's subscriber reads, a plain one and one of another token do not;
    the plugin changes vLLM's queue module only where the token is set."""
    import zmq

    from spice_megatron.rollout import engine_channels

    def context(token: str):
        class Context(zmq.Context):
            _socket_class = engine_channels.curve_socket_class(token)

        return Context()

    writer = context(TOKEN).socket(zmq.XPUB)
    writer.setsockopt(zmq.XPUB_VERBOSE, True)
    writer.bind("tcp://127.0.0.1:0")
    address = writer.getsockopt(zmq.LAST_ENDPOINT).decode()
    readers = {}
    for name, ctx in (("job", context(TOKEN)), ("plain", zmq.Context()), ("other token", context("not-the-job's"))):
        readers[name] = ctx.socket(zmq.SUB)
        readers[name].setsockopt_string(zmq.SUBSCRIBE, "")
        readers[name].RCVTIMEO = 1500
        readers[name].connect(address)
    writer.RCVTIMEO = 5000
    assert writer.recv() == b"\x01"  # one subscription: the job's reader
    time.sleep(0.5)
    writer.send(b"a prompt's token ids")
    assert readers["job"].recv() == b"a prompt's token ids"
    for name in ("plain", "other token"):
        with pytest.raises(zmq.Again):
            readers[name].recv()
    from vllm.distributed.device_communicators import shm_broadcast

    before = shm_broadcast.Context
    monkeypatch.setattr(engine_channels, "_PATCHED", False)
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    engine_channels.encrypt_engine_channels()
    assert shm_broadcast.Context is before  # no token: vLLM as it is
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    monkeypatch.setattr(shm_broadcast, "Context", before)
    engine_channels.encrypt_engine_channels()
    assert issubclass(shm_broadcast.Context._socket_class, zmq.Socket) and shm_broadcast.Context is not before
