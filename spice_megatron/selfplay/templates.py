"""Conversation templates per model family (SPICE.md, "Reasoner prompt templates"), and the
reasoner's prompt, which training and evaluation share.

- `qwen3`: Qwen3's chat format (ChatML) with the system prompt "You are a helpful assistant."; the
  reasoner's question is followed by "Please reason step by step, and put your final answer within
  \\boxed{}." Written out literally, so that a base model's tokenizer needs no chat template.
- `qwen3_nothink`: the same with the empty think block that Qwen3's own chat template writes for
  enable_thinking=False: a hybrid Qwen3 model (the strong-challenger baseline's Qwen3-32B) answers
  directly, as the paper's "Qwen3-32B-Instruct", instead of thinking through its output budget.
- `octothinker`: no chat template (Llama-3 base): a one-paragraph conversation preamble, then
  "User: {question} You must put your answer inside \\boxed{}." and "Assistant:".
- `chat`: the tokenizer's own chat template (instruct models such as the CPU demo's SmolLM2).
- `plain`: plain text with the project's own instruction (base models of other families).

A prompt's token ids come from one rule, `prompt_token_ids`, in training, evaluation, co-evolution
and the fixed challenger alike: the engines always receive token ids, never text that vLLM would
tokenise by a rule of its own.

A user can replace any prompt with a file (`selfplay.prompt_dir`): `reasoner.txt` with
`{question}` here, and the challenger's files in `protocol.py`. Placeholders are replaced
literally (no str.format), so templates may contain JSON braces.
"""
from __future__ import annotations

import os

from spice_megatron.config.selfplay import TEMPLATES
from spice_megatron.tasks import Task

QWEN3_SYSTEM = "You are a helpful assistant."
QWEN3_NO_THINKING = "<think>\n\n</think>\n\n"  # what Qwen3's chat template adds for enable_thinking=False
QWEN3_REASONER_SUFFIX = "Please reason step by step, and put your final answer within \\boxed{}."
OCTOTHINKER_PREAMBLE = (
    "A conversation between User and Assistant. The User asks a question and the Assistant answers it. The "
    "Assistant first reasons about the question step by step, then gives the User the final answer.")
OCTOTHINKER_REASONER_SUFFIX = "You must put your answer inside \\boxed{}."
PLAIN_REASONER = ("Solve the following problem. Reason step by step, then give the final answer on its own as "
                  "\\boxed{{answer}}.")
MCQ_HINT = "For a multiple-choice question, the answer is the letter of the correct option."


def read_prompt_file(prompt_dir: str, name: str) -> str | None:
    """The text of prompt_dir/name, or None when there is no such override."""
    if not prompt_dir:
        return None
    path = os.path.join(prompt_dir, name)
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return f.read()


def conversation(template: str, user: str, tokenizer=None) -> str:
    """One user turn in the family's format, ending where the model's answer begins."""
    if template in ("qwen3", "qwen3_nothink"):
        turn = (f"<|im_start|>system\n{QWEN3_SYSTEM}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
                "<|im_start|>assistant\n")
        return turn + QWEN3_NO_THINKING if template == "qwen3_nothink" else turn
    if template == "octothinker":
        return f"{OCTOTHINKER_PREAMBLE}\n\nUser: {user}\nAssistant:"
    if template == "chat":
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ValueError("selfplay.template=chat needs a tokenizer with a chat template")
        return tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                             add_generation_prompt=True)
    if template == "plain":
        return user
    raise ValueError(f"selfplay.template: unknown template {template!r} ({', '.join(TEMPLATES)})")


def prompt_token_ids(prompt: str, tokenizer) -> list[int]:
    """The token ids of a rendered prompt: with the tokenizer's special tokens, as vLLM adds them to a
    text prompt (a Llama-3 tokenizer's <|begin_of_text|>: the paper's Oat actors sent text, so its
    rollouts and evaluations began with it), unless the text already begins with the BOS (a chat
    template writes it), which would make two."""
    bos = getattr(tokenizer, "bos_token", None)
    add = not (isinstance(bos, str) and bos and prompt.startswith(bos))
    return list(tokenizer(prompt, add_special_tokens=add)["input_ids"])


def reasoner_prompt(task: Task, template: str = "plain", tokenizer=None, prompt_dir: str = "") -> str:
    """The reasoner's prompt: the question only (never the document), in the family's format."""
    question = task.reasoner_text()
    if task.answer_type == "multiple_choice":
        question += f"\n\n{MCQ_HINT}"
    custom = read_prompt_file(prompt_dir, "reasoner.txt")
    if custom is not None:
        user = custom.replace("{question}", question)
    elif template in ("qwen3", "qwen3_nothink"):
        user = f"{question}\n{QWEN3_REASONER_SUFFIX}"
    elif template == "octothinker":
        user = f"{question} {OCTOTHINKER_REASONER_SUFFIX}"
    else:
        user = PLAIN_REASONER.format() + f"\n\nProblem:\n{question}\n"
    prompt = conversation(template, user, tokenizer)
    return prompt + "\nSolution:\n" if template == "plain" and custom is None else prompt
