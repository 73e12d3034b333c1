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


def _slow_engine(monkeypatch, fleet, statuses):
    """A stand-in engine whose first /generate read times out; /status answers from `statuses` (an
    exception: the engine does not answer). Returns the posted bodies."""
    import requests

    posts = []

    def control(e, path, body, method="POST", timeout=None):
        if path == "/status":
            status = statuses.pop(0) if statuses else {"pid": 1, "steps": 0, "running": 1}
            if isinstance(status, Exception):
                raise status
            return status
        posts.append(body)
        if len(posts) == 1:
            raise requests.ReadTimeout("read timed out")
        return pack_completions([[Completion(text=p, token_ids=[1], logprobs=[0.0])] * body["sampling"]["n"]
                                 for p in body["prompts"]])

    monkeypatch.setattr(fleet, "_control", control)
    fleet.liveness_interval = 0.0
    return posts


def test_a_request_that_outlives_its_timeout_on_a_working_engine_is_waited_for(monkeypatch):
    """One 64-prompt request took longer than the
    read timeout, the only engine was taken for dead and NoEngineLeft ended a check whose engine was
    working. An engine whose /status answers and whose steps advance is waited for: the request is
    posted again under its id (the engine answers with the first post's completions), not failed."""
    fleet = RolloutFleet(["http://engine"], "token", chunk_size=64)
    posts = _slow_engine(monkeypatch, fleet, [{"pid": 7, "steps": 10, "running": 64},
                                              {"pid": 7, "steps": 12, "running": 64}])
    try:
        out = fleet.generate([f"p{i}" for i in range(64)], SamplingSpec(n=1, max_tokens=4, seed=1))
    finally:
        fleet.close()
    engine = fleet.engines[0]
    assert [c[0].text for c in out] == [f"p{i}" for i in range(64)]
    assert len(posts) == 2 and posts[0]["request_id"] == posts[1]["request_id"] and posts[0]["request_id"]
    assert engine.healthy and engine.failures == 0


def test_an_engine_that_answers_but_does_not_step_or_stops_answering_is_taken_for_dead(monkeypatch):
    import pytest
    import requests

    from spice_megatron.rollout.fleet import FleetError, NoEngineLeft

    for statuses in ([{"pid": 7, "steps": 10, "running": 3}, {"pid": 7, "steps": 10, "running": 3}],  # stuck
                     [requests.ConnectionError("refused")],  # gone
                     [{"pid": 7, "steps": 10, "running": 3}, {"pid": 8, "steps": 11, "running": 3}]):  # restarted
        fleet = RolloutFleet(["http://engine"], "token", chunk_size=64)
        _slow_engine(monkeypatch, fleet, statuses)
        try:
            with pytest.raises((NoEngineLeft, FleetError)):
                fleet.generate(["p"], SamplingSpec(n=1, max_tokens=4, seed=1))
        finally:
            fleet.close()
        assert not fleet.engines[0].healthy and fleet.engines[0].failures == 1
