"""Model cards from the templates in `adaflash_hf/templates/` (package resources), and Hub pushes that include them."""

from __future__ import annotations

import tempfile
from importlib.resources import as_file, files

from huggingface_hub import HfApi, ModelCard, ModelCardData

CARD_TAGS = ["adaflash", "dflash", "speculative-decoding"]


def render_model_card(template: str, *, repo_id: str, base_model: str | None = None, **fields) -> ModelCard:
    """Renders `adaflash_hf/templates/<template>.md` with `fields`; `base_model` goes into the card metadata."""
    data = ModelCardData(library_name="adaflash-hf", tags=CARD_TAGS, base_model=base_model)
    name = repo_id.rstrip("/").split("/")[-1]
    with as_file(files("adaflash_hf") / "templates" / f"{template}.md") as path:
        return ModelCard.from_template(
            data, template_path=str(path), model_name=name, repo_id=repo_id, base_model=base_model, **fields
        )


def drafter_card_fields(drafter, card_data: dict | None = None) -> dict:
    config = drafter.config
    fields = {
        "block_size": config.block_size,
        "target_layer_ids": list(config.target_layer_ids),
        "num_hidden_layers": config.num_hidden_layers,
        "mask_token_id": config.mask_token_id,
        "length_head": "yes" if config.use_length_head else "no (fixed-length drafting)",
        "length_policy": config.length_policy,
        "draft_vocab": (
            "the whole vocabulary"
            if config.draft_vocab is None
            else f"{len(config.draft_vocab)} tokens (`adaflash_config.draft_vocab`; SGLang and vLLM draft over the "
            "whole vocabulary)"
        ),
        "base_model": getattr(config, "target_model", None),
        "training_recipe": None,
        "acceptance": None,
        "training_data": None,
        "evaluation": None,
    }
    fields.update(card_data or {})
    return fields


def push_folder(repo_id: str, write, *, private=None, token=None, revision=None, create_pr=False, commit_message=None):
    """Creates the repo if needed, lets `write(folder)` fill a temporary folder, and uploads it in one commit."""
    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    with tempfile.TemporaryDirectory() as folder:
        write(folder)
        return api.upload_folder(
            repo_id=repo_id,
            folder_path=folder,
            commit_message=commit_message or "Upload AdaFlash drafter",
            revision=revision,
            create_pr=create_pr,
        )


def push_drafter_to_hub(drafter, repo_id: str, *, card_data: dict | None = None, save_format="dflash", **kwargs):
    """`AdaFlashDrafter.push_to_hub`: the official-schema checkpoint plus a README rendered from `drafter.md`."""
    card = render_model_card("drafter", repo_id=repo_id, **drafter_card_fields(drafter, card_data))

    def write(folder):
        drafter.save_pretrained(folder, save_format=save_format)
        card.save(f"{folder}/README.md")

    return push_folder(repo_id, write, **kwargs)


def push_length_head_to_hub(head, repo_id: str, **kwargs):
    """Pushes a standalone `AdaptiveLengthHead` with a README rendered from `length_head.md`."""
    config = head.config
    card = render_model_card(
        "length_head", repo_id=repo_id, base_drafter=config.base_drafter, block_size=config.block_size
    )

    def write(folder):
        head.save_pretrained(folder)
        card.save(f"{folder}/README.md")

    return push_folder(repo_id, write, commit_message=kwargs.pop("commit_message", "Upload length head"), **kwargs)
