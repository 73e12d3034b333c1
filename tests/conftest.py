import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from leftovers import SUITE_MARKER, kill, wait_for_leftovers  # noqa: E402

# Every process a test starts carries this (workers inherit it from the session's first process):
# the session's end finds what outlived its test by it.
os.environ.setdefault(SUITE_MARKER, f"{os.getpid()}-{time.time_ns()}")

# Offline by construction: nothing may reach a model or dataset hub during tests.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


# The modules that take minutes (CI's --durations), longest first. tools/env/run_tests.sh runs xdist's
# loadfile with --no-loadscope-reorder, which hands out modules in collection order: started first,
# these end together instead of one of them running alone on one core at the end (xdist's own
# order puts modules with the most tests first, which put all of these last).
LONGEST_FIRST = ("test_slurm_box.py", "test_trainer_resilience.py", "test_trainer_faults.py", "test_trainer.py",
                 "test_selfplay_learning.py",
                 "test_rollout.py", "test_eval.py", "test_policy.py", "test_moe.py", "test_gpu_check.py",
                 "test_recipes.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def qwen3_tokenizer():
    from transformers import AutoTokenizer

    from spice_megatron.data.offline_assets import qwen3_tokenizer_dir

    return AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())


@pytest.fixture(scope="session")
def verifier():
    from spice_megatron.selfplay.verify import AnswerVerifier

    v = AnswerVerifier(processes=2, soft_timeout=2, hard_timeout=6.0)
    yield v
    v.close()


@pytest.fixture(scope="session")
def bos_tokenizer():
    """A byte-level tokenizer that adds a BOS to every text, as Llama-3's adds <|begin_of_text|>,
    and whose chat template writes the BOS itself; built offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    vocab.update({"<s>": len(vocab), "</s>": len(vocab) + 1})
    tok = Tokenizer(models.BPE(vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = ("{{ bos_token }}{% for m in messages %}User: {{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}Assistant:{% endif %}")
    return fast


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    """The session fails if a process a test started is still alive at its end (after a grace for
    helpers that watch their parent), naming the test; the leftovers are killed."""
    if hasattr(session.config, "workerinput"):  # an xdist worker: the session's first process checks
        return
    me = os.getpid()
    xdist = session.config.pluginmanager.has_plugin("dsession")  # its workers are this process's children
    left = wait_for_leftovers(os.environ[SUITE_MARKER], {me}, grace_s=30.0,
                              ignore=lambda pid: _parent(pid) == me and (xdist or _is_resource_tracker(pid)))
    if not left:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    lines = [f"  pid {pid}, started by {what}" for pid, what in sorted(left.items())]
    message = f"{len(left)} process(es) outlived the test that started them (killed now):\n" + "\n".join(lines)
    if reporter:
        reporter.write_sep("=", "processes left behind", red=True)
        reporter.write_line(message)
    else:
        print(message, file=sys.stderr)
    kill(left)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _is_resource_tracker(pid: int) -> bool:
    """multiprocessing's resource tracker of this very process (a test used multiprocessing in it,
    without xdist): it lives as long as its parent, by design, and ends with it."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"multiprocessing.resource_tracker" in f.read()
    except OSError:
        return False


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


@pytest.fixture(scope="module")
def module_dir(request, tmp_path_factory):
    """A folder for what one test module's tests share (a model, its runs), removed when the module
    ends with none of its tests failed (kept to look at otherwise): the end-to-end modules write
    gigabytes of checkpoints, and a suite that keeps them all fills a CI machine's disk."""
    path = tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1])
    failed = request.session.testsfailed
    yield path
    if request.session.testsfailed == failed:
        shutil.rmtree(path, ignore_errors=True)
