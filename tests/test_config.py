import pytest

from spice_megatron.config import (ConfigError, CorpusConfig, OptimConfig, PolicyTrainConfig, SelfPlayConfig,
                                   SourceConfig, apply_overrides)


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
