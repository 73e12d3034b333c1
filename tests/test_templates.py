"""The reasoner's prompt per model family; training and evaluation share it."""
import threading

import pytest

from spice_megatron.selfplay.templates import conversation, reasoner_prompt
from spice_megatron.tasks import Task

INT = Task("What is 6 times 7?", "42", "integer")
MCQ = Task("Which is a metal?", "C", "multiple_choice", ("wood", "glass", "iron", "cloth"))


def test_qwen3_chat_format_with_its_system_prompt():
    p = reasoner_prompt(INT, "qwen3")
    assert p == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhat is 6 times 7?\n"
                 "Please reason step by step, and put your final answer within \\boxed{}.<|im_end|>\n"
                 "<|im_start|>assistant\n")


def test_octothinker_conversation_format():
    p = reasoner_prompt(INT, "octothinker")
    assert p.startswith("A conversation between User and Assistant.")
    assert p.endswith("User: What is 6 times 7? You must put your answer inside \\boxed{}.\nAssistant:")


def test_mcq_options_and_letter_hint_in_every_template(qwen3_tokenizer):
    for template in ("plain", "chat", "qwen3", "octothinker"):
        p = reasoner_prompt(MCQ, template, qwen3_tokenizer)
        assert "C) iron" in p and "letter of the correct option" in p, template


def test_chat_needs_a_chat_template_and_unknown_templates_are_named():
    with pytest.raises(ValueError, match="chat template"):
        conversation("chat", "hi", tokenizer=None)
    with pytest.raises(ValueError, match="selfplay.template: unknown template 'llama2'"):
        conversation("llama2", "hi")


def test_recipes_choose_their_family_template_and_eval_uses_it(tmp_path, monkeypatch, capsys):
    from recipes import get_recipe

    assert get_recipe("qwen3_4b").selfplay.template == get_recipe("qwen3_8b").selfplay.template == "qwen3"
    assert get_recipe("octothinker_3b").selfplay.template == get_recipe("octothinker_8b").selfplay.template == \
        "octothinker"
    # the demo: plain text with its few-shot prompt folder (the chat template gave 0 valid tasks of 128)
    tiny = get_recipe("tiny_cpu").selfplay
    assert tiny.template == "plain" and tiny.prompt_dir.endswith("prompts/stories") and tiny.reasoner_stop == ["\nQ:"]

    import spice_megatron.eval.run as run
    captured = {}

    def fake_run_evaluation(model, names, out, data, source, limit, settings, **kw):
        captured["settings"] = settings
        raise FileNotFoundError("stop here")
    monkeypatch.setattr(run, "run_evaluation", fake_run_evaluation)
    from spice_megatron.cli import main

    main(["eval", "--model", str(tmp_path), "--recipe", "octothinker_3b", "--benchmarks", "gsm8k"])
    assert captured["settings"].template == "octothinker"
    main(["eval", "--model", str(tmp_path), "--recipe", "octothinker_3b", "--template", "qwen3"])
    assert captured["settings"].template == "qwen3"
    main(["eval", "--model", str(tmp_path), "--recipe", "tiny_cpu", "--benchmarks", "gsm8k"])  # its prompts and stop
    assert (captured["settings"].prompt_dir, captured["settings"].stop) == (tiny.prompt_dir, ("\nQ:",))


def test_prompt_token_ids_add_the_bos_once(bos_tokenizer):
    from spice_megatron.selfplay.templates import prompt_token_ids

    bos = bos_tokenizer.bos_token_id
    plain = prompt_token_ids("Q: 2+3?", bos_tokenizer)
    assert plain[0] == bos and plain.count(bos) == 1
    chat = prompt_token_ids(conversation("chat", "Q: 2+3?", bos_tokenizer), bos_tokenizer)  # the template writes it
    assert chat[0] == bos and chat.count(bos) == 1


def test_engines_receive_the_same_ids_in_training_evaluation_coevolution_and_fixed_challenger(bos_tokenizer):
    """D1: training sent ids without the BOS while evaluation sent text that vLLM tokenised with it."""
    from types import SimpleNamespace

    from spice_megatron.config import SelfPlayConfig
    from spice_megatron.data.corpus import Document
    from spice_megatron.eval import analysis
    from spice_megatron.eval.benchmarks import BENCHMARKS, EvalItem, LoadedBenchmark
    from spice_megatron.eval.harness import EvalSettings, evaluate_benchmark
    from spice_megatron.loop.driver import Driver
    from spice_megatron.selfplay.protocol import ChallengerPrompts
    from spice_megatron.wire.types import Completion, SamplingSpec

    sent: dict[str, list] = {}

    def recorder(path):
        def generate(prompts, spec, one_engine=False):
            sent[path] = prompts[0]
            return [[Completion("\\boxed{5}", [1], [0.0], "stop")] * spec.n for _ in prompts]
        return generate

    cfg = SelfPlayConfig(template="octothinker", protocol="compact")
    task = Task("What is 2 plus 3?", "5", "integer")
    reasoner = reasoner_prompt(task, cfg.template, bos_tokenizer)
    training = SimpleNamespace(_ids={}, _ids_lock=threading.Lock(), tokenizer=bos_tokenizer)
    sent["training"] = Driver.prompt_ids(training, reasoner)
    evaluate_benchmark(LoadedBenchmark(BENCHMARKS["gsm8k"], [EvalItem("1", task.question, "5", "integer")], "s"),
                       recorder("evaluation"), _NoVerifier(), bos_tokenizer, EvalSettings(template=cfg.template))
    analysis._answer(SimpleNamespace(generate=recorder("coevolution")), [task], bos_tokenizer, cfg, _NoVerifier(), 1)
    assert sent["training"][0] == bos_tokenizer.bos_token_id and sent["training"].count(bos_tokenizer.bos_token_id) == 1
    assert sent["evaluation"] == sent["coevolution"] == sent["training"]

    doc = Document("d", "Gus had 5 cards and got 8 more. Now Gus has 13 cards.", "s", 0, 0, "sha", 20)
    challenger = ChallengerPrompts(cfg.template, bos_tokenizer, "").compact_prompt(doc.text)
    fixed = SimpleNamespace(challenger_fleet=SimpleNamespace(generate=recorder("fixed")),
                            challenger_tokenizer=bos_tokenizer, _ids_lock=threading.Lock())
    Driver.fixed_challenger_generate(fixed, [challenger], SamplingSpec(n=1))
    analysis._challenger_tasks(SimpleNamespace(generate=recorder("coevolution_challenger")), [doc], bos_tokenizer,
                               cfg, 1, attempts=1)
    assert sent["fixed"] == sent["coevolution_challenger"] == Driver.prompt_ids(training, challenger)


class _NoVerifier:
    def verify_batch(self, items):
        return [False for _ in items]


def test_qwen3_nothink_is_qwen3_with_the_empty_think_block_of_enable_thinking_false(qwen3_tokenizer):
    turn = conversation("qwen3_nothink", "Write a task.")
    assert turn == conversation("qwen3", "Write a task.") + "<think>\n\n</think>\n\n"
    # what Qwen3's own chat template writes with enable_thinking=False
    own = qwen3_tokenizer.apply_chat_template([{"role": "system", "content": "You are a helpful assistant."},
                                               {"role": "user", "content": "Write a task."}], tokenize=False,
                                              add_generation_prompt=True, enable_thinking=False)
    assert own == turn
