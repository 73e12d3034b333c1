"""Do the challenger's requests fit the engines' context (rollout.max_model_len)?

A request is a prompt (the document inside the recipe's prompt text and template) plus the tokens it
may generate. vLLM caps the output silently when prompt + max_tokens exceed max_model_len, and
rejects a prompt that alone reaches it, which would stop the run. So:
- at start-up, `check_context_budget` measures the actual prompts (files under selfplay.prompt_dir
  included) around an empty document and refuses a configuration whose longest document
  (corpus.max_doc_tokens) cannot fit, naming the fields and the numbers;
- at run time, `run_iteration` skips a document whose request would not fit (counted in
  `skipped/prompt_too_long`, logged with its id) and makes a task whose question is too long for the
  reasoner's request an invalid attempt (`invalid/question_over_context`).
"""
from __future__ import annotations

import functools
import os

from spice_megatron.config import ConfigError, SelfPlayConfig, SpiceConfig
from spice_megatron.selfplay.protocol import ChallengerPrompts, Selection
from spice_megatron.selfplay.templates import prompt_token_ids
from spice_megatron.tasks import ANSWER_TYPES

# A document's tokens inside a prompt can differ from its tokens alone by a merge at each edge.
EDGE_TOKENS = 2


def challenger_requests(prompts: ChallengerPrompts, document: str, cfg: SelfPlayConfig) -> list[tuple[str, str, int]]:
    """Every request the challenger can make for `document`: (what, prompt, max_tokens)."""
    if cfg.protocol == "compact":
        return [("challenger prompt", prompts.compact_prompt(document), cfg.challenger_max_tokens)]
    return [("selection prompt", prompts.selection_prompt(document), cfg.selection_max_tokens)] + [
        (f"{kind} generation prompt", prompts.generation_prompt(document, Selection(kind)), cfg.challenger_max_tokens)
        for kind in ANSWER_TYPES]


def request_tokens(prompt: str, max_tokens: int, tokenizer) -> int:
    return len(prompt_token_ids(prompt, tokenizer)) + max_tokens


def challenger_overheads(prompts: ChallengerPrompts, cfg: SelfPlayConfig, tokenizer) -> list[tuple[str, int, int]]:
    """Every challenger request around an empty document: (what, prompt tokens, max_tokens). A
    document of n tokens makes a request of prompt tokens + n + EDGE_TOKENS + max_tokens, so a
    document is checked by its token count (Document.num_tokens), not by tokenising it again."""
    return [(what, len(prompt_token_ids(prompt, tokenizer)), max_tokens)
            for what, prompt, max_tokens in challenger_requests(prompts, "", cfg)]


def check_context_budget(cfg: SpiceConfig, tokenizer) -> None:
    """Refuse (ConfigError naming the fields and numbers) when the longest document a run can draw
    does not fit, with the challenger's longest request, in rollout.max_model_len."""
    sp = cfg.selfplay
    if sp.challenger == "tasks":
        return
    prompts = ChallengerPrompts(sp.template, tokenizer, sp.prompt_dir)
    limit = cfg.rollout.max_model_len
    for what, prompt_len, max_tokens in challenger_overheads(prompts, sp, tokenizer):
        worst = prompt_len + cfg.corpus.max_doc_tokens + EDGE_TOKENS + max_tokens
        if worst > limit:
            where = f"the files in selfplay.prompt_dir={sp.prompt_dir}" if sp.prompt_dir else "the built-in prompts"
            output = "selfplay.selection_max_tokens" if what == "selection prompt" else "selfplay.challenger_max_tokens"
            raise ConfigError(
                f"rollout.max_model_len={limit} cannot hold the challenger's longest request: the {what} ({where}, "
                f"template {sp.template}) is {prompt_len} tokens + a document of up to corpus.max_doc_tokens="
                f"{cfg.corpus.max_doc_tokens} + {output}={max_tokens} = {worst} tokens; raise rollout.max_model_len "
                f"to at least {worst} or lower corpus.max_doc_tokens")


CHECKED_ENV = "SPICE_CONTEXT_BUDGET_CHECKED"


def check_context_budget_once(cfg: SpiceConfig, tokenizer) -> bool:
    """check_context_budget, unless this process or the one that started it (the CLI, before
    torchrun: the environment is inherited) has checked these very settings. Returns whether it
    checked. A cluster launcher's ranks were started by no such process: rank 0 checks."""
    import hashlib
    import json

    sp = cfg.selfplay
    key = hashlib.sha256(json.dumps([type(tokenizer).__name__, len(tokenizer), cfg.rollout.max_model_len,
                                     cfg.corpus.max_doc_tokens, sp.protocol,
                                     sp.challenger, sp.template, sp.prompt_dir, sp.challenger_max_tokens,
                                     sp.selection_max_tokens]).encode()).hexdigest()[:16]
    if os.environ.get(CHECKED_ENV) == key:
        return False
    check_context_budget(cfg, tokenizer)
    os.environ[CHECKED_ENV] = key
    return True


@functools.lru_cache(maxsize=8)  # the planner asks once per layout it tries: a tokenizer load each took 0.6 s
def _planning_tokenizer(model: str):
    """The tokenizer of run.model for planning without its weights: a local directory's, the
    bundled Qwen3 tokenizer for a Qwen3 hub id (one vocabulary for the family), else None."""
    from transformers import AutoTokenizer

    try:
        if os.path.isdir(model):
            return AutoTokenizer.from_pretrained(model)
        if model.startswith("Qwen/Qwen3"):
            from spice_megatron.data.offline_assets import qwen3_tokenizer_dir

            return AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())
    except (OSError, ValueError):
        return None
    return None


def longest_sequence(cfg: SpiceConfig, tokenizer=None) -> tuple[int, str]:
    """The longest sequence the learner can be given (a micro-batch of its own, whatever
    train.micro_batch_tokens says), and what bounds it: the challenger's longest request with the
    longest document when the prompts can be measured, else rollout.max_model_len."""
    sp, limit = cfg.selfplay, cfg.rollout.max_model_len
    tokenizer = tokenizer or _planning_tokenizer(cfg.run.model)
    if sp.challenger == "tasks" or tokenizer is None:
        return limit, "rollout.max_model_len"
    prompts = ChallengerPrompts(sp.template, tokenizer, sp.prompt_dir)
    worst = max(prompt_len + cfg.corpus.max_doc_tokens + EDGE_TOKENS + max_tokens
                for _, prompt_len, max_tokens in challenger_overheads(prompts, sp, tokenizer))
    return min(worst, limit), "the challenger's longest request (prompt + corpus.max_doc_tokens + output)"
