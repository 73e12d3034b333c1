"""The learner's old log-probs during a streamed iteration's rollouts (streamed_forward.py); end to
end: test_trainer_resilience.py."""
import queue

from spice_megatron.streamed_forward import _next_chunk, overlaps


def test_a_chunk_is_every_document_complete_so_far_and_the_end_comes_after_it():
    chunks = queue.Queue()
    for item in (["a"], ["b", "c"], None):
        chunks.put(item)
    assert _next_chunk(chunks) == ["a", "b", "c"]
    assert _next_chunk(chunks) is None
    chunks.put(["d"])
    assert _next_chunk(chunks) == ["d"]


def test_only_an_on_policy_disaggregated_streamed_run_with_several_steps_per_batch_overlaps():
    from recipes import get_recipe

    cfg = get_recipe("qwen3_8b")  # the paper's: 128 trajectories per update, disaggregated, streamed
    assert overlaps(cfg)
    for field, value in (("run.streamed", False), ("run.colocate", True), ("train.max_staleness", 1),
                         ("train.old_logprobs", "rollout"), ("train.trajectories_per_update", 0)):
        other = get_recipe("qwen3_8b")
        section, name = field.split(".")
        setattr(getattr(other, section), name, value)
        assert not overlaps(other), field
    assert not overlaps(get_recipe("tiny_cpu"))  # one step per batch: no old log-probs to run
