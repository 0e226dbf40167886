"""The call's adaflash_* settings are read and validated in one place (`generation/options.py`): defaults from the
drafter, per-call overrides, one error naming every problem, and misspelt settings refused."""

import pytest
import torch
from helpers import tiny_drafter, tiny_target
from transformers import GenerationConfig

from adaflash_hf.generation.options import AdaFlashGenerationOptions


@pytest.fixture(scope="module")
def drafter():
    return tiny_drafter(tiny_target())


def test_defaults_come_from_the_drafter_and_overrides_from_the_call(drafter):
    options = AdaFlashGenerationOptions.from_generation_config(GenerationConfig(), drafter.config)
    assert options.length_policy.length_policy == drafter.config.length_policy
    assert (options.tree_budget, options.verify_layout, options.draft_head_dtype) == (None, "auto", "auto")
    assert options.decoding_loop == "adaflash" and options.adapter_names is None
    config = GenerationConfig(
        adaflash_length_policy="confidence",
        adaflash_confidence_threshold=0.2,
        adaflash_tree_budget=8,
        adaflash_verify_layout="linear",
        adaflash_draft_head_dtype="torch.bfloat16",
    )
    options = AdaFlashGenerationOptions.from_generation_config(config, drafter.config)
    assert options.length_policy.length_policy == "confidence" and options.length_policy.confidence_threshold == 0.2
    assert (options.tree_budget, options.verify_layout, options.draft_head_dtype) == (8, "linear", "bfloat16")


def test_every_problem_is_named_in_one_error(drafter):
    config = GenerationConfig(
        adaflash_tree_budget=0,
        adaflash_verify_layout="fast",
        adaflash_length_rate=-1.0,
        adaflash_draft_head_dtype="int8",
    )
    with pytest.raises(ValueError) as error:
        AdaFlashGenerationOptions.from_generation_config(config, drafter.config)
    message = str(error.value)
    for part in ("adaflash_tree_budget", "adaflash_verify_layout='fast'", "adaflash_length_rate", "'int8'"):
        assert part in message


def test_a_misspelt_setting_is_refused_with_the_valid_names(drafter):
    config = GenerationConfig(max_new_tokens=4, adaflash_tree_budjet=8)
    with pytest.raises(ValueError, match=r"adaflash_tree_budjet is not an adaflash_hf generation setting.*"
                       r"adaflash_tree_budget"):  # fmt: skip
        AdaFlashGenerationOptions.from_generation_config(config, drafter.config)
    target = tiny_target()
    with pytest.raises(ValueError, match="adaflash_tree_budjet"):  # generate() refuses it before anything runs
        target.generate(torch.tensor([[0, 5, 9]]), generation_config=config, assistant_model=tiny_drafter(target))


def test_settings_the_transformers_loop_cannot_honour_are_refused(drafter):
    config = GenerationConfig(adaflash_decoding_loop="transformers", adaflash_tree_budget=8)
    with pytest.raises(ValueError, match="adaflash_tree_budget needs adaflash_hf's loop"):
        AdaFlashGenerationOptions.from_generation_config(config, drafter.config)
    config = GenerationConfig(adaflash_decoding_loop="both")
    with pytest.raises(ValueError, match="adaflash_decoding_loop='both' must be 'adaflash' or 'transformers'"):
        AdaFlashGenerationOptions.from_generation_config(config, drafter.config)


def test_the_listed_names_are_exactly_the_fields():
    names = AdaFlashGenerationOptions.attribute_names()
    assert "adaflash_length_policy" in names and "adaflash_adapter_names" in names
    assert all(name.startswith("adaflash_") for name in names) and len(names) == len(set(names)) == 16
