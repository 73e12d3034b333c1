"""The rollout fleet's client side (spice_megatron/rollout/fleet.py) against a stand-in for the
engines' HTTP answers: what it posts, when."""
import threading
import time

from spice_megatron.rollout.fleet import RolloutFleet
from spice_megatron.wire.types import Completion, SamplingSpec, pack_completions


def test_requests_beyond_an_engines_room_wait_unposted_and_every_prompt_is_answered(monkeypatch):
    """1,000 sequences to one engine whose vLLM runs 32 at once: at most twice that posted at a time (a
    request's timeout runs from its post, not from the batch's start), every prompt answered, in order."""
    fleet = RolloutFleet(["http://engine"], "token", chunk_size=16)
    engine, peak, lock = fleet.engines[0], [0], threading.Lock()

    def control(e, path, body, method="POST", timeout=None):
        if path == "/status":
            return {"status": "ok", "workers": 1, "max_num_seqs": 32}
        with lock:
            peak[0] = max(peak[0], e.posted)
        time.sleep(0.01)
        n = body["sampling"]["n"]
        return pack_completions([[Completion(text=str(p), token_ids=[len(str(p))], logprobs=[0.0])] * n
                                 for p in body["prompts"]])

    monkeypatch.setattr(fleet, "_control", control)
    assert fleet.health()["http://engine"] is not None and engine.room == 64
    try:
        out = fleet.generate([f"p{i}" for i in range(250)], SamplingSpec(n=4, max_tokens=4, seed=1))
    finally:
        fleet.close()
    assert 0 < peak[0] <= 64 and engine.posted == 0 and engine.in_flight == 0
    assert [comps[0].text for comps in out] == [f"p{i}" for i in range(250)] and all(len(c) == 4 for c in out)
    assert engine.requests == 1000 // 16 + (1 if 1000 % 16 else 0)
