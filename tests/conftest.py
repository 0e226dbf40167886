import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Runtime profiles stay in memory: tests build many models of identical configs, which would share one profile file
# (tests/test_profile.py points the folder at a temporary one).
os.environ.setdefault("ADAFLASH_HF_PROFILE_DIR", "none")

import importlib.util  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# What the suite needs beyond the library's own dependencies, and where each comes from.
TEST_REQUIREMENTS = {
    "scipy": "pip install -e '.[dev]'",
    "matplotlib": "pip install -e '.[plot]'",
    "adaflash_demo": "pip install -e ./demo",
}


def pytest_configure(config):
    """Stops at once, naming the install commands, instead of failing test modules one by one on their imports."""
    missing = {name: hint for name, hint in TEST_REQUIREMENTS.items() if importlib.util.find_spec(name) is None}
    if missing:
        raise pytest.UsageError(
            f"The test suite needs {', '.join(missing)}: run {'; '.join(dict.fromkeys(missing.values()))} "
            "(or `make test`, which installs everything)."
        )


# Tiny models gain nothing from a second thread; two OpenMP threads on shared cores spin-wait (measured 40x slower).
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tokenizer():
    """The synthetic language's tokenizer (tests/synthetic.py)."""
    from synthetic import synthetic_tokenizer

    return synthetic_tokenizer()


@pytest.fixture(scope="session")
def target(tokenizer):
    """A tiny target that has learnt the synthetic language (trained once per session, in seconds)."""
    from synthetic import train_target

    return train_target(tokenizer)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def word_tokenizer():
    """A character-level tokenizer over the tiny models' 128 ids (ids 0-3 special, then printable characters)."""
    import string

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    names = ["<s>", "</s>", "<pad>", "<unk>"] + list(string.ascii_letters + string.digits + string.punctuation)
    names += [f"<{i}>" for i in range(len(names), 128)]
    backend = Tokenizer(models.WordLevel({name: i for i, name in enumerate(names)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )


@pytest.fixture(scope="session")
def synthetic_checkpoints(tmp_path_factory, target, tokenizer):
    """The synthetic target (with its tokenizer) and an untrained drafter with a length head, saved as the
    directories the command lines take (``--target``, ``--drafter``): end-to-end runs in seconds."""
    from synthetic import synthetic_drafter

    root = tmp_path_factory.mktemp("checkpoints")
    target.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    synthetic_drafter(target, tokenizer, use_length_head=True).save_pretrained(root / "drafter")
    return str(root / "target"), str(root / "drafter")
