import pytest

from spice_megatron.config import (
    ConfigError,
    CorpusConfig,
    OptimConfig,
    PolicyTrainConfig,
    RunConfig,
    SelfPlayConfig,
    SourceConfig,
    apply_overrides,
)


def test_paper_defaults():
    cfg = SelfPlayConfig()
    assert (cfg.batch_docs, cfg.group_size, cfg.max_attempts, cfg.invalid_penalty) == (128, 8, 1024, -0.1)
    assert cfg.challenger_temperature == cfg.reasoner_temperature == 1.0
    assert CorpusConfig().max_doc_tokens == 5992 and CorpusConfig().max_docs == 20000


@pytest.mark.parametrize("cfg,field", [
    (SelfPlayConfig(group_size=1), "selfplay.group_size"),
    (SelfPlayConfig(challenger_reward="entropy"), "selfplay.challenger_reward"),
    (SelfPlayConfig(top_p=0), "selfplay.top_p"),
    (OptimConfig(decay_style="cosine", decay_steps=None), "optim.decay_steps"),
    (OptimConfig(min_lr=1.0, lr=1e-3), "optim.min_lr"),
    (PolicyTrainConfig(old_logprobs="cache"), "train.old_logprobs"),
    (SelfPlayConfig(reasoner_task="easiest"), "selfplay.reasoner_task"),
    (RunConfig(model="m", driver="ray"), "run.driver"),
])
def test_validation_names_the_field(cfg, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        cfg.validate()


def test_overrides_parse_by_field_type_and_name_bad_keys():
    cfg = CorpusConfig(sources=[SourceConfig(path="x.jsonl")])
    apply_overrides(cfg, ["max_doc_tokens=1024", "max_docs=none", "seed=7"])
    assert (cfg.max_doc_tokens, cfg.max_docs, cfg.seed) == (1024, None, 7)
    sp = apply_overrides(SelfPlayConfig(), ["template=qwen3", "top_p=0.9", "protocol=compact"])
    assert sp.template == "qwen3" and sp.top_p == 0.9 and sp.protocol == "compact"
    with pytest.raises(ConfigError, match="max_doc_tokenz: no such config field"):
        apply_overrides(cfg, ["max_doc_tokenz=3"])
    with pytest.raises(ConfigError, match="max_doc_tokens: cannot parse 'many' as int"):
        apply_overrides(cfg, ["max_doc_tokens=many"])
    with pytest.raises(ConfigError, match="key=value"):
        apply_overrides(cfg, ["max_doc_tokens"])


def test_staleness_and_weight_transfer_choices_are_validated():
    from spice_megatron.config import ConfigError, ParallelConfig, PolicyTrainConfig, RolloutConfig

    with pytest.raises(ConfigError, match="train.max_staleness: must be 0"):
        PolicyTrainConfig(max_staleness=2).validate()
    with pytest.raises(ConfigError, match="train.tis_cap"):
        PolicyTrainConfig(tis_cap=0.5).validate()
    with pytest.raises(ConfigError, match="old_logprobs=rollout"):
        PolicyTrainConfig(max_staleness=1, old_logprobs="rollout").validate()
    assert PolicyTrainConfig(max_staleness=1).use_tis and not PolicyTrainConfig().use_tis
    assert PolicyTrainConfig(importance_sampling="on").use_tis
    with pytest.raises(ConfigError, match="rollout.sleep_level"):
        RolloutConfig(sleep_level=3).validate()
    with pytest.raises(ConfigError, match="rollout.weight_transfer: needs a resharding plan"):
        RolloutConfig(weight_transfer="nccl_m2n").validate()
    with pytest.raises(ConfigError, match="unknown backend 'gloo'"):
        RolloutConfig(weight_transfer="gloo").validate()
    from recipes.tiny_cpu import tiny_cpu

    cfg = tiny_cpu(model="m")
    cfg.parallel, cfg.rollout.weight_transfer = ParallelConfig(pipeline_parallel=2), "nccl"
    with pytest.raises(ConfigError, match="rollout.weight_transfer: nccl is vLLM's backend: no bucket is signed"):
        cfg.validate()
    cfg.rollout.unsigned_sync = True
    with pytest.raises(ConfigError, match="holds only pipeline stage 0 of 2: use spice"):
        cfg.validate()
    cfg = tiny_cpu(model="m")
    cfg.rollout.weight_transfer = "ipc"
    with pytest.raises(ConfigError, match="rollout.weight_transfer: ipc .* needs run.colocate=true"):
        cfg.validate()
    cfg.run.colocate, cfg.train.max_staleness = True, 1
    with pytest.raises(ConfigError, match="train.max_staleness: must be 0 with run.colocate"):
        cfg.validate()
    cfg.train.max_staleness, cfg.rollout.weight_transfer, cfg.rollout.unsigned_sync = 0, "nccl", True
    with pytest.raises(ConfigError, match="nccl cannot put two ranks on one GPU"):
        cfg.validate()
    cfg.rollout.weight_transfer = "ipc"
    cfg.validate()


def test_learner_temperature_must_match_the_trained_roles():
    from recipes.tiny_cpu import tiny_cpu

    cfg = tiny_cpu(model="m")
    cfg.validate()
    cfg.selfplay.challenger_temperature = 1.0
    with pytest.raises(ConfigError, match=r"train.temperature: must equal selfplay.challenger_temperature \(1.0\)"):
        cfg.validate()
    cfg.selfplay.challenger = "tasks"  # a fixed challenger is not trained: its temperature is free
    cfg.selfplay.tasks_file = __file__
    cfg.validate()


def test_none_is_a_word_for_text_fields_and_nothing_for_the_others():
    from spice_megatron.config import SpiceConfig

    cfg = apply_overrides(SpiceConfig(), ["selfplay.grounding=none", "corpus.max_docs=none"])
    assert cfg.selfplay.grounding == "none" and cfg.corpus.max_docs is None
    cfg.selfplay.validate()
