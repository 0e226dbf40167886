"""The real target's prompts and drafter recipe: the document split, the prompt builders and the recipe's pieces
that need no target (the end-to-end build is `adaflash-demo recipe`, measured in BENCHMARKS.md)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from adaflash_demo import instructions, recipe
from adaflash_demo.sources import Document, is_heldout

MODULE = '''
def short(x):
    return x


def documented(a, b):
    """Adds two numbers.

    Longer description.
    """
    total = a + b
    if total > 10:
        total -= 1
    return total


class Thing:
    def method(self, items):
        out = []
        for item in items:
            out.append(item * 2)
        return out
'''


def test_functions_of_takes_functions_and_methods_within_bounds_with_their_signature():
    config = instructions.InstructionConfig(min_function_lines=4)
    found = {
        name: (source, signature)
        for name, source, signature in instructions.functions_of(Document("code:pkg/mod.py", MODULE), config)
    }
    assert set(found) == {"documented", "method"}  # `short` has 2 lines
    source, signature = found["documented"]
    assert source.startswith("def documented(a, b):") and source.rstrip().endswith("return total")
    assert signature.startswith("def documented(a, b):") and '"""' in signature and "total = a + b" not in signature
    assert found["method"][0].startswith("def method(self, items):")  # dedented


def test_math_prompts_keep_the_question_and_never_the_worked_answer():
    document = next(instructions.source_documents("math", seed=3))
    (row,) = instructions.PROMPT_BUILDERS["math"](document, instructions.InstructionConfig(), random.Random(0))
    assert "Answer:" not in row["prompt"] and "####" not in row["prompt"] and "<<" not in row["prompt"]
    assert document.text.split("\nAnswer:")[0].removeprefix("Question:").strip() in row["prompt"]


def test_changelog_entry_is_the_newest_entry_up_to_its_sign_off():
    text = (
        "pkg (2.0-1) unstable; urgency=medium\n\n  * New upstream release.\n\n -- A B <a@b.org>  Tue, 03 Jan 2023\n\n"
        "pkg (1.0-1) unstable; urgency=low\n\n  * Initial release.\n\n -- A B <a@b.org>  Mon, 02 Jan 2023\n"
    )
    entry = instructions.changelog_entry(text)
    assert entry.startswith("pkg (2.0-1)") and entry.endswith("Tue, 03 Jan 2023") and "1.0-1" not in entry


def test_shell_prompts_are_commands_only():
    config, rng = instructions.InstructionConfig(), random.Random(0)
    assert instructions.PROMPT_BUILDERS["shell"](Document("man:man2/open.2.gz", "x" * 300), config, rng) == []
    assert instructions.PROMPT_BUILDERS["shell"](Document("man:man1/gcloud-x.1.gz", "x" * 300), config, rng) == []
    (row,) = instructions.PROMPT_BUILDERS["shell"](Document("man:man1/ls.1.gz", "NAME\n ls - list\n"), config, rng)
    assert "`ls`" in row["prompt"]


@pytest.mark.parametrize("domain", ["math", "docs", "code"])
def test_split_is_by_document_and_recorded(domain):
    config = instructions.InstructionConfig(train_per_domain=40, heldout_per_domain=6, heldout_percent=20.0)
    rows = instructions.build_domain(domain, config, seed=0)
    assert len(rows["train"]) == 40 and len(rows["heldout"]) == 6
    train_docs = {row["doc_id"] for row in rows["train"]}
    heldout_docs = {row["doc_id"] for row in rows["heldout"]}
    assert not train_docs & heldout_docs
    assert all(is_heldout(doc, 20.0) for doc in heldout_docs) and not any(is_heldout(d, 20.0) for d in train_docs)
    assert {row["split"] for row in rows["train"]} == {"train"} and {r["domain"] for r in rows["heldout"]} == {domain}


def test_a_named_run_shares_the_builds_data_and_keeps_its_own_outputs(tmp_path):
    main = recipe.Layout(recipe.RecipeConfig(work_dir=str(tmp_path)))
    run = recipe.Layout(recipe.RecipeConfig(work_dir=str(tmp_path), run_name="loss-ce"))
    assert (run.prompts, run.answers, run.features) == (main.prompts, main.answers, main.features)
    assert run.trainer.name == "trainer-loss-ce" and run.drafter.name == "drafter-loss-ce"
    assert run.evaluation.name == "evaluation-loss-ce.json" and main.drafter.name == "drafter"


def test_training_prompts_interleave_the_domains(tmp_path):
    layout = recipe.Layout(recipe.RecipeConfig(work_dir=str(tmp_path)))
    layout.prompts.mkdir(parents=True)
    for domain in instructions.TRAINED_DOMAINS:
        rows = [{"prompt": f"{domain}-{i}", "domain": domain} for i in range(3 if domain != "math" else 1)]
        (layout.prompts / f"{domain}.train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    order = [row["prompt"] for row in recipe.training_prompts(layout)]
    assert order[:4] == ["code-0", "docs-0", "shell-0", "math-0"]
    assert order[4:] == ["code-1", "docs-1", "shell-1", "code-2", "docs-2", "shell-2"]


def test_validation_prompts_are_the_heldout_prompts_not_measured(tmp_path):
    config = recipe.RecipeConfig(work_dir=str(tmp_path), eval_prompts_per_domain=2)
    layout = recipe.Layout(config)
    layout.prompts.mkdir(parents=True)
    for domain in instructions.TRAINED_DOMAINS:
        rows = [{"prompt": f"{domain}-{i}"} for i in range(5)]
        (layout.prompts / f"{domain}.heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts = [row["prompt"] for row in recipe.validation_prompts(layout, config)]
    assert prompts == [f"{d}-{i}" for d in instructions.TRAINED_DOMAINS for i in (2, 3, 4)]


def test_unknown_stage_is_named():
    with pytest.raises(ValueError, match="Unknown stage.*'tune'.*prompts, answers, features, train, evaluate, ship"):
        recipe.RecipeConfig(stages=["prompts", "tune"])


def test_recipe_yaml_sets_only_known_fields():
    from trl import TrlParser

    (config,) = TrlParser((recipe.RecipeConfig,)).parse_args_and_config(
        ["--config", str(Path(__file__).parents[1] / "demo/recipes/smollm2-drafter.yaml"), "--max_steps", "7"]
    )
    assert config.max_steps == 7 and config.block_size == 16 and config.target_layer_ids == [1, 10, 19, 27]


def test_answer_shards_restrict_training_and_name_missing_ones(tmp_path):
    layout = recipe.Layout(recipe.RecipeConfig(work_dir=str(tmp_path)))
    layout.answers.mkdir(parents=True)
    for index in (0, 1, 5):
        row = {"prompt_ids": [index], "completion_ids": [index]}
        (layout.answers / f"shard-{index:04d}.jsonl").write_text(json.dumps(row) + "\n")
    (layout.answers / "validation.jsonl").write_text(json.dumps({"prompt_ids": [9], "completion_ids": [9]}) + "\n")
    assert [r["prompt_ids"] for r in recipe.load_answers(layout)] == [[0], [1], [5]]
    assert [r["prompt_ids"] for r in recipe.load_answers(layout, shards=[0, 5])] == [[0], [5]]
    assert [r["prompt_ids"] for r in recipe.load_answers(layout, "validation")] == [[9]]
    with pytest.raises(FileNotFoundError, match=r"lacks \['shard-0002.jsonl'\].*`answers` stage"):
        recipe.load_answers(layout, shards=[0, 2])


def test_draft_vocabulary_comes_from_the_training_answers_with_the_end_of_sequence(tmp_path):
    config = recipe.RecipeConfig(work_dir=str(tmp_path), draft_vocab_size=3, answer_shards=[0])
    layout = recipe.Layout(config)
    layout.answers.mkdir(parents=True)
    rows = [{"prompt_ids": [50, 50, 50], "completion_ids": [7, 7, 8, 9, 9, 9, 2]}]
    (layout.answers / "shard-0000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (layout.answers / "shard-0001.jsonl").write_text(json.dumps({"prompt_ids": [1], "completion_ids": [4] * 9}) + "\n")
    (layout.answers / "validation.jsonl").write_text(
        json.dumps({"prompt_ids": [1], "completion_ids": [9, 7, 5, 2]}) + "\n"
    )

    class Tokenizer:
        eos_token_id = 2

    # prompts and unused shards do not count; the end of sequence is kept even where it is rare
    vocab = recipe.draft_vocabulary(layout, config, Tokenizer())
    assert vocab == [2, 7, 9]
    assert recipe._draft_vocab_report(layout, vocab) == {"size": 3, "validation_coverage": 0.75}
    assert recipe.draft_vocabulary(layout, recipe.RecipeConfig(work_dir=str(tmp_path)), Tokenizer()) is None
