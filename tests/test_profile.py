"""The runtime profile (`generation/profile.py`): one object per (target, drafter) pair holds what the loop measured,
resettable, and kept in a profile file that a new process starts from; a corrupt or foreign file is ignored with one
warning and rewritten."""

import json
import shutil
import warnings

import pytest
import torch
from helpers import tiny_drafter, tiny_target
from test_generate_batched import PAD, PROMPTS
from transformers import GenerationConfig

import adaflash_hf
from adaflash_hf import AdaFlashDrafter
from adaflash_hf.generation.profile import PROFILE_FORMAT, RuntimeProfile, profile_for

PLANNED = dict(
    max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=PAD, adaflash_length_policy="planned"
)


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv("ADAFLASH_HF_PROFILE_DIR", str(tmp_path))
    return tmp_path


def _generate(target, drafter, **overrides):
    config = GenerationConfig(**{**PLANNED, **overrides})
    with adaflash_hf.record_stats() as stats:
        out = target.generate(torch.tensor([PROMPTS[0]]), generation_config=config, assistant_model=drafter)
    return out, stats.calls[0]


def test_a_new_process_starts_from_the_file(folder):
    target = tiny_target()
    out, call = _generate(target, tiny_drafter(target))
    files = list(folder.glob("*.json"))
    assert len(files) == 1 and call.profile == str(files[0]) and not call.profile_loaded
    payload = json.loads(files[0].read_text())
    assert payload["format"] == PROFILE_FORMAT and payload["key"]["torch_version"] == torch.__version__
    measured = payload["profile"]["cost_tables"]["cpu/torch.float32"]["step_s"]
    assert "1,1" in measured  # the planner measured a plain step first

    # models of the same configs in a new process (here: new objects) find the file and start from it
    again = tiny_target()
    drafter = tiny_drafter(again)
    profile = profile_for(again, drafter)
    assert profile.loaded and profile.cost_table(torch.device("cpu"), torch.float32).step_s
    out_again, call = _generate(again, drafter)
    assert call.profile_loaded and torch.equal(out, out_again)


def test_the_same_checkpoint_loaded_from_another_folder_keeps_its_profile(folder, tmp_path_factory):
    models = tmp_path_factory.mktemp("models")
    tiny_target().save_pretrained(models / "target")
    tiny_drafter(tiny_target()).save_pretrained(models / "drafter")
    moved_folder = tmp_path_factory.mktemp("moved") / "checkout"
    shutil.copytree(models, moved_folder)  # a moved checkout: the same files in another folder
    target = type(tiny_target()).from_pretrained(models / "target")
    drafter = AdaFlashDrafter.from_pretrained(models / "drafter")
    _generate(target, drafter)
    moved = type(target).from_pretrained(moved_folder / "target")
    moved_drafter = AdaFlashDrafter.from_pretrained(moved_folder / "drafter")
    assert moved_drafter.config._name_or_path != drafter.config._name_or_path
    assert profile_for(moved, moved_drafter).loaded
    assert len(list(folder.glob("*.json"))) == 1
    # a drafter of another shape is another pair
    assert not profile_for(moved, tiny_drafter(moved, num_hidden_layers=1)).loaded


def test_reset_forgets_every_measurement(folder):
    target = tiny_target()
    drafter = tiny_drafter(target)
    _generate(target, drafter)
    profile = profile_for(target, drafter)
    assert profile.to_dict()["cost_tables"]
    profile.reset()
    assert profile.to_dict() == {"cost_tables": {}, "layouts": [], "head_kernels": []}


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        json.dumps({"format": PROFILE_FORMAT, "key": {"machine": "elsewhere"}, "profile": {}}),
        json.dumps({"format": PROFILE_FORMAT + 1}),
    ],
    ids=["corrupt", "foreign", "another format"],
)
def test_an_unusable_file_is_ignored_with_one_warning_and_rewritten(folder, content):
    target = tiny_target()
    _generate(target, tiny_drafter(target))  # writes the pair's file
    (path,) = folder.glob("*.json")
    path.write_text(content)
    again = tiny_target()
    drafter = tiny_drafter(again)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, call = _generate(again, drafter)
    ours = [w for w in caught if "runtime profile" in str(w.message)]
    assert len(ours) == 1 and "ignoring" in str(ours[0].message) and not call.profile_loaded
    assert json.loads(path.read_text())["format"] == PROFILE_FORMAT  # rewritten from this process's measurements


def test_profiles_stay_in_memory_when_asked(tmp_path, monkeypatch):
    monkeypatch.setenv("ADAFLASH_HF_PROFILE_DIR", "none")
    target = tiny_target()
    _, call = _generate(target, tiny_drafter(target))
    assert call.profile is None and list(tmp_path.iterdir()) == []


def test_the_file_form_round_trips():
    profile = RuntimeProfile()
    profile.cost_table(torch.device("cpu"), torch.float32).observe(3, 2, 0.25)
    profile.layouts.choices[3] = "transposed"
    profile.head_kernels.choices[(("cpu", (128, 64), None), 2, True, True)] = "onednn"
    profile.head_kernels.choices[(("cpu", (128, 64), (2, 77)), 15, True, True)] = "bfloat16"
    state = json.loads(json.dumps(profile.to_dict()))
    copy = RuntimeProfile()
    copy.load_dict(state)
    assert copy.to_dict() == profile.to_dict()
    assert (
        copy.layouts.chosen(3) == "transposed"
        and copy.head_kernels.chosen((("cpu", (128, 64), None), 2, True, True)) == "onednn"
        and copy.head_kernels.chosen((("cpu", (128, 64), (2, 77)), 15, True, True)) == "bfloat16"
    )
    state["head_kernels"][0][1] = "float8"
    with pytest.raises(ValueError, match="unknown layout 'float8'"):
        RuntimeProfile().load_dict(state)


def test_a_profile_of_one_path_rate_stands_for_every_depth():
    """Profiles written before merged paths were modelled per depth hold one rate: it is every depth's prior."""
    profile = RuntimeProfile()
    profile.cost_table(torch.device("cpu"), torch.float32).observe(1, 1, 0.1)
    state = profile.to_dict()
    (table,) = state["cost_tables"].values()
    table["path_acceptance"] = 0.7
    copy = RuntimeProfile()
    copy.load_dict(state)
    depths = copy.cost_table(torch.device("cpu"), torch.float32).path_acceptance
    assert len(depths) > 1 and depths == [0.7] * len(depths)
    table["path_acceptance"] = [0.7, 0.9]  # another depth count than this version models: unusable
    with pytest.raises(ValueError, match="depths"):
        RuntimeProfile().load_dict(state)
