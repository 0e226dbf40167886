"""`cut_after_eos`: a generated row keeps its tokens up to and including its first end-of-sequence token."""

from transformers import GenerationConfig

from adaflash_hf.generation.stopping import cut_after_eos


def test_a_row_ends_at_its_first_eos_of_any_id():
    config = GenerationConfig(eos_token_id=[7, 9], pad_token_id=0)
    assert cut_after_eos([3, 4, 9, 0, 0], config) == [3, 4, 9]
    assert cut_after_eos([7, 9, 0], config) == [7]


def test_a_row_without_eos_is_kept_whole():
    assert cut_after_eos([3, 4, 5], GenerationConfig(eos_token_id=2)) == [3, 4, 5]
    assert cut_after_eos([3, 4, 5], GenerationConfig()) == [3, 4, 5]
