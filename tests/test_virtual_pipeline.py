"""Virtual pipeline stages (parallel.virtual_pipeline, megatron's interleaved 1F1B) and uneven
stages: the same log-probs, step, checkpoint and HF export as one stage (gloo, CPU)."""
import pytest
import torch
from dist_utils import run_ranks
from learner_checks import assert_same_as_one_rank, assert_same_moe_step, replayed_moe_step, step_checkpoint_resume

from spice_megatron.config import ConfigError, ParallelConfig
from spice_megatron.data.offline_assets import make_tiny_hf_model, tiny_hf_config
from spice_megatron.policy.batching import TrainSequence, make_microbatches


def batch(flip: bool = False) -> list[TrainSequence]:
    g = torch.Generator().manual_seed(9)
    seqs = []
    for i, (p, c) in enumerate([(5, 6), (3, 4), (4, 7), (2, 5), (6, 3)]):
        ids = torch.randint(0, 256, (p + c,), generator=g).tolist()
        adv = [0.8, -0.5, 0.3, -0.6, 0.4][i]
        seqs.append(TrainSequence(ids[:p], ids[p:], advantage=-adv if flip else adv))
    return seqs


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("shared_prefix", ["off", "on"])
def test_virtual_pipeline_stages_step_as_one_stage_and_their_checkpoint_resumes_without_them(tmp_path, shared_prefix):
    """4 layers at PP=2 x VPP=2 (each rank holds layers 0 and 2, or 1 and 3, as two chunks): the
    interleaved schedule's log-probs, step and weights are one stage's; its micro-batch count is a
    multiple of PP (masked fillers); a checkpoint saved with virtual stages resumes at PP=2 without."""
    model = make_tiny_hf_model(str(tmp_path / "m"), tiny_hf_config("qwen3", num_layers=4), seed=4)
    train = {"shared_prefix": shared_prefix, "max_gen_len": 8, "micro_batch_tokens": 16}
    (ref,) = run_ranks(step_checkpoint_resume, 1, model, {}, str(tmp_path / "c1"), {}, train, batch, tmp_path=tmp_path)
    got = run_ranks(step_checkpoint_resume, 2, model, {"pipeline_parallel": 2, "virtual_pipeline": 2},
                    str(tmp_path / "c2"), {"pipeline_parallel": 2}, train, batch, tmp_path=tmp_path)[0]
    assert got["chunks"] == 2 and got["micro_batches"] % 2 == 0
    assert_same_as_one_rank(got, ref)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_virtual_pipeline_stages_replay_each_chunks_routing_under_full_recompute(tmp_path):
    """A 4-layer Qwen3-MoE at PP=2 x VPP=2, engine routing replayed, every layer recomputed: each
    chunk's routers take back their own micro-batches' experts; log-probs, step and weights are one
    rank's."""
    model = make_tiny_hf_model(str(tmp_path / "moe"), tiny_hf_config("qwen3_moe", num_layers=4), seed=1)
    train = {"micro_batch_tokens": 13, "recompute": "full"}
    (ref,) = run_ranks(replayed_moe_step, 1, model, {}, train, tmp_path=tmp_path)
    got = run_ranks(replayed_moe_step, 2, model, {"pipeline_parallel": 2, "virtual_pipeline": 2}, train,
                    tmp_path=tmp_path)[0]  # rank 0 has the gathered weights
    assert_same_moe_step(got, ref)


def test_virtual_pipeline_layouts_are_checked_and_micro_batch_counts_rounded():
    from spice_megatron.families import model_spec_from_hf
    from spice_megatron.policy.model import check_parallel_layout

    spec = model_spec_from_hf(tiny_hf_config("qwen3", num_layers=6))
    check_parallel_layout(spec, 1, 2, vpp=3)
    with pytest.raises(ConfigError, match=r"parallel.virtual_pipeline: pipeline_parallel x virtual_pipeline = 2 x 2 "
                                          r"does not divide num_hidden_layers=6"):
        check_parallel_layout(spec, 1, 2, vpp=2)
    with pytest.raises(ConfigError, match="parallel.virtual_pipeline: needs pipeline_parallel > 1"):
        ParallelConfig(virtual_pipeline=2).validate()
    with pytest.raises(ConfigError, match="parallel.virtual_pipeline: with uneven stages"):
        ParallelConfig(pipeline_parallel=2, virtual_pipeline=2, first_stage_layers=1).validate()
    mbs = make_microbatches(batch(), 1, 0, 16, count_multiple=4)
    assert len(mbs) == 4 and sum(int(mb.loss_mask.sum()) for mb in mbs) == sum(len(s.completion_ids) for s in batch())


@pytest.mark.multiprocess
@pytest.mark.slow
def test_uneven_stages_checkpoint_and_export_as_one_stage(tmp_path):
    """3 layers at PP=2 as 1 + 2 (parallel.first_stage_layers): the HF import, a step, the export and
    a checkpoint that resumes at PP=1 x DP=2, as one stage computes them."""
    model = make_tiny_hf_model(str(tmp_path / "m"), tiny_hf_config("qwen3", num_layers=3), seed=4)
    train = {"max_gen_len": 8, "micro_batch_tokens": 16}
    (ref,) = run_ranks(step_checkpoint_resume, 1, model, {}, str(tmp_path / "c1"), {}, train, batch, tmp_path=tmp_path)
    got = run_ranks(step_checkpoint_resume, 2, model, {"pipeline_parallel": 2, "first_stage_layers": 1},
                    str(tmp_path / "c2"), {}, train, batch, tmp_path=tmp_path)[0]
    assert_same_as_one_rank(got, ref)
