"""`render_prompt`, the one place a request meets the chat template: the same ids for serving and for training."""

import copy

import pytest
from datasets import Dataset

from adaflash_hf.chat import render_prompt
from adaflash_hf.training.rollouts import encode_dataset

# a Qwen3-like template: a BOS-like marker, the turns, and a thinking block that `enable_thinking=False` closes
TEMPLATE = (
    "<s>{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% if enable_thinking is defined and not enable_thinking %}"
    "<think></think> {% endif %}{% endif %}"
)


@pytest.fixture
def chat_tokenizer(word_tokenizer):
    """The character-level tokenizer with the template, adding a BOS to what it encodes as Llama's does."""
    from tokenizers import processors

    tokenizer = copy.deepcopy(word_tokenizer)  # the session's tokenizer keeps no template
    tokenizer.chat_template = TEMPLATE
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 0)]
    )
    return tokenizer


def test_a_user_turn_renders_with_a_generation_prompt_and_no_thinking(chat_tokenizer):
    assert render_prompt(chat_tokenizer, "hi") == "<s>[user] hi [assistant] <think></think> "
    assert render_prompt(chat_tokenizer, "hi", enable_thinking=True) == "<s>[user] hi [assistant] "
    conversation = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert render_prompt(chat_tokenizer, conversation).startswith("<s>[system] be brief [user] hi [assistant]")


def test_ids_are_the_rendered_text_without_special_tokens_added_twice(chat_tokenizer):
    ids = render_prompt(chat_tokenizer, "hi", tokenize=True)
    text = render_prompt(chat_tokenizer, "hi")
    assert ids == chat_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids != chat_tokenizer(text)["input_ids"]  # the control: the tokenizer alone would add a BOS again


def test_training_rollouts_render_a_conversation_as_serving_does(chat_tokenizer):
    messages = [{"role": "user", "content": "hi"}]
    encoded = encode_dataset(Dataset.from_dict({"messages": [messages]}), chat_tokenizer, {"enable_thinking": False})
    assert encoded[0]["prompt_ids"] == render_prompt(chat_tokenizer, "hi", tokenize=True)


def test_without_a_template_text_is_continued_and_a_conversation_is_refused(word_tokenizer):
    assert word_tokenizer.chat_template is None
    assert render_prompt(word_tokenizer, "def add(a, b):") == "def add(a, b):"
    assert render_prompt(word_tokenizer, "ab", tokenize=True) == word_tokenizer("ab")["input_ids"]
    with pytest.raises(ValueError, match="no chat template, so it cannot render a conversation"):
        render_prompt(word_tokenizer, [{"role": "user", "content": "hi"}])
