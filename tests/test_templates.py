"""The reasoner's prompt per model family; training and evaluation share it."""
import pytest

from spice_megatron.tasks import Task
from spice_megatron.templates import conversation, reasoner_prompt

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
