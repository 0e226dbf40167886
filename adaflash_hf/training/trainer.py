"""`OPDTrainer`: on-policy distillation of an AdaFlash / DFlash drafter from its frozen target.

Subclass of TRL's `DistillationTrainer`, which already provides what OPD needs around the loss: the generation-batch
sampler and buffering over gradient accumulation, DDP/FSDP forward redirection, PEFT wrapping, teacher placement
and metric plumbing. OPD replaces three hooks:

- ``_generate_and_score_completions``: the *target* answers, not the student. TRL's per-batch
  ``_generate_single_turn`` is bypassed: rollouts are generated per round for the whole prompt set
  (`rollouts.generate_completions`, the single generation call) and cached on disk, so a resumed run reloads them;
- ``compute_loss``: the DFlash block forward and the AdaFlash losses (docs/algorithm.md §4), instead of a
  causal-LM divergence;
- ``create_model_card``: our drafter card, since TRL's text-generation quick start does not apply to a drafter.
"""

from __future__ import annotations

import inspect
import os
import textwrap
import warnings
from pathlib import Path

import torch
from accelerate import Accelerator
from datasets import Dataset
from transformers import GenerationConfig
from trl import DistillationTrainer

from ..draft_vocab_rows import vocab_ids
from ..hub import drafter_card_fields, render_model_card
from .blocks import block_loss_weights, sample_anchors
from .config import OPDConfig
from .features import FeatureCache, draft_blocks, slot_targets, slot_teacher, target_features
from .losses import (
    LOSS_DIVERGENCES,
    TeacherTop,
    accepted_drafts,
    drafting_loss,
    length_head_labels,
    length_head_loss,
    row_statistics,
    selector_loss,
)
from .rollouts import (
    RolloutStore,
    check_columns,
    collate_sequences,
    encode_dataset,
    generate_completions,
    is_offline,
    rollout_fingerprint,
    rollout_generation_config,
)

LENGTH_HEAD_PREFIX = "thresh_head_two_model"

TESTED_VERSIONS = "trl 1.16 and accelerate 1.15"
# Private internals OPDTrainer relies on: what DistillationTrainer sets and calls, and the attribute accelerate's
# prepare_model leaves on a model whose forward it wraps in autocast (`_restore_forward`).
_TRL_INTERNALS = (
    "self._tokenizer =",
    "self.eos_token_ids =",
    "self._metrics =",
    "self._forward_redirection =",
    "self._generate_and_score_completions(",
)
_ACCELERATE_INTERNALS = ("_original_forward",)


def missing_internals(trainer_cls=DistillationTrainer, prepare_model=Accelerator.prepare_model) -> list[str]:
    """The private TRL and accelerate internals OPDTrainer relies on that these versions lack (read from source)."""
    trl_source, accelerate_source = inspect.getsource(trainer_cls), inspect.getsource(prepare_model)
    return [f"trl {trainer_cls.__name__}: {name}" for name in _TRL_INTERNALS if name not in trl_source] + [
        f"accelerate {prepare_model.__qualname__}: {name}"
        for name in _ACCELERATE_INTERNALS
        if name not in accelerate_source
    ]


def _warn_if_internals_changed() -> None:
    missing = missing_internals()
    if missing:
        warnings.warn(
            f"adaflash_hf.training: OPDTrainer relies on private internals these TRL/accelerate versions lack "
            f"({missing}); training may fail or misbehave. It is tested with {TESTED_VERSIONS} (see pyproject.toml).",
            stacklevel=3,
        )


_warn_if_internals_changed()


def _base_drafter(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _restore_forward(model) -> None:
    """Undoes the autocast wrapper accelerate's `prepare_model` puts on ``model.forward`` under bf16/fp16 (in
    evaluation mode too). OPD reads the teacher's features from its inner model and never needs the wrapper, and
    leaving it would make the caller's target generate in reduced precision from then on: no longer lossless against
    the model passed in. (``unwrap_model(keep_fp32_wrapper=False)`` is not used: it also peels transformers' own
    decorators off ``forward``.)"""
    original = vars(model).pop("_original_forward", None)
    if original is None:
        return
    if getattr(original, "__func__", None) is type(model).forward:
        vars(model).pop("forward", None)  # the class's forward applies again, exactly as before
    else:
        model.forward = original


class OPDTrainer(DistillationTrainer):
    """
    Trainer for on-policy distillation (OPD) of an AdaFlash / DFlash drafter from its target. The target answers the
    training prompts itself (its rollouts, regenerated every `rollout_refresh_steps` with the current drafter as its
    assistant), and the drafter learns to draft those answers a block at a time: AdaFlash's loss, a cross-entropy to
    the target's argmax plus a clipped reverse KL to the target's distribution, over many blocks per sequence, and
    optionally the adaptive length head (docs/algorithm.md §4, §6).

    Example:

    ```python
    >>> from datasets import load_dataset
    >>> from transformers import AutoModelForCausalLM, AutoTokenizer

    >>> from adaflash_hf import AdaFlashDrafter, OPDConfig, OPDTrainer

    >>> target = AutoModelForCausalLM.from_pretrained("Qwen/Qwen3-8B", dtype="bfloat16")
    >>> tokenizer = AutoTokenizer.from_pretrained("Qwen/Qwen3-8B")
    >>> drafter = AdaFlashDrafter.from_pretrained("z-lab/Qwen3-8B-DFlash-b16")
    >>> dataset = load_dataset("json", data_files="prompts.jsonl", split="train")  # a `prompt` column

    >>> trainer = OPDTrainer(
    ...     model=drafter,
    ...     teacher_model=target,
    ...     args=OPDConfig("Qwen3-8B-AdaFlash", bf16=True),
    ...     train_dataset=dataset,
    ...     processing_class=tokenizer,
    ... )
    >>> trainer.train()
    ```

    Args:
        model ([`AdaFlashDrafter`] or [`~peft.PeftModel`]):
            The drafter to train, instantiated (`AdaFlashDrafter.from_pretrained(...)`, or a fresh
            `AdaFlashDrafter(AdaFlashConfig.from_target_config(target.config, ...))`), optionally with a length head;
            or a PEFT model wrapping one. Model ids are not accepted: a drafter is not a causal LM.
        teacher_model ([`~transformers.PreTrainedModel`]):
            The target the drafter drafts for, instantiated. It is frozen, and so are its input embeddings and
            output head, which the drafter borrows.
        args ([`OPDConfig`], *optional*):
            Configuration for this trainer. If `None`, a default configuration is used.
        train_dataset ([`~datasets.Dataset`]):
            Prompts to train on, which the target answers on-policy: a `"prompt"` column (text) or a `"messages"`
            column (a conversation, templated with `chat_template_kwargs` and `enable_thinking`). Rows that also
            have a `"completion"` or `"response"` column, or conversations ending in an assistant turn, are trained
            on as given (offline distillation), without rollouts.
        eval_dataset ([`~datasets.Dataset`] or `dict[str, Dataset]`, *optional*):
            Dataset to evaluate on, with the same columns as `train_dataset`.
        processing_class ([`~transformers.PreTrainedTokenizerBase`]):
            The target's tokenizer; the drafter has none of its own.
        callbacks (list of [`~transformers.TrainerCallback`], *optional*):
            Callbacks added to the default ones of [`~transformers.Trainer`].
        optimizers (`tuple[Optimizer | None, LambdaLR | None]`, *optional*, defaults to `(None, None)`):
            Optimizer and scheduler. By default AdamW with two parameter groups (the drafter at `learning_rate`,
            the length head at `length_head_learning_rate`) and the scheduler `args` configure.
        peft_config ([`~peft.PeftConfig`], *optional*):
            PEFT configuration used to wrap the drafter (for example LoRA adapters per domain). Add
            `modules_to_save=["thresh_head_two_model"]` to train a length head alongside the adapters.

    Logged metrics (training, and with an `eval_` prefix on `eval_dataset`), on target-greedy data:

        - `acceptance_length`: accepted drafts + 1 at the sampled anchors, averaged over anchors.
        - `step_acceptance_length`: the same blocks' harmonic mean. The acceptance length the decoding loop
          measures (tokens per verification) lies between the two: the anchor average overstates it wherever easy and
          hard stretches alternate, because the loop crosses an easy stretch in few steps; the harmonic mean
          understates it (docs/algorithm.md §4.12).
        - `draft_accuracy`: drafter argmax equal to the teacher's argmax, over every supervised slot.
        - `loss/*`: the loss's parts; `length_head/mae` and `loss/length_head` with a length head.
    """

    _tag_names = ["trl", "adaflash", "dflash", "speculative-decoding"]
    _name = "OPD"
    # The method the trainer is named after; AdaFlash and DFlash have no paper id recorded in this repository.
    _paper = {
        "title": "On-Policy Distillation of Language Models: Learning from Self-Generated Mistakes",
        "id": "2306.13649",
        # docstyle-ignore
        "citation": textwrap.dedent("""\
            @inproceedings{agarwal2024on-policy,
                title        = {{On-Policy Distillation of Language Models: Learning from Self-Generated Mistakes}},
                author       = {Rishabh Agarwal and Nino Vieillard and Yongchao Zhou and Piotr Stanczyk and
                                Sabela Ramos Garea and Matthieu Geist and Olivier Bachem},
                year         = 2024,
                booktitle    = {The Twelfth International Conference on Learning Representations, {ICLR} 2024,
                                Vienna, Austria, May 7-11, 2024},
                publisher    = {OpenReview.net},
                url          = {https://openreview.net/forum?id=3zKtaqxLhW},
            }"""),
    }
    # Losses are per-micro-batch weighted means (docs/algorithm.md §4.10), so Trainer divides them by the
    # accumulation steps.
    loss_is_scaled_for_ga = False

    def __init__(
        self,
        model,
        teacher_model,
        args: OPDConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        callbacks=None,
        optimizers=(None, None),
        peft_config=None,
    ):
        if args is None:
            args = OPDConfig("opd-drafter")
        self._check_arguments(model, teacher_model, args, processing_class, train_dataset)
        self._prepare_models(_base_drafter(model), teacher_model, args, processing_class)
        train_dataset, eval_dataset = self._encode_datasets(train_dataset, eval_dataset, args, processing_class)
        super().__init__(
            model=model,
            teacher_model=teacher_model,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            peft_config=peft_config,
        )
        self._check_length_head_trainable()
        _restore_forward(self.accelerator.unwrap_model(self.teacher_model))
        self._rollout_generation_config = rollout_generation_config(args, self._tokenizer, self.eos_token_ids)
        self._rollout_store = RolloutStore(
            args.rollout_dir or Path(args.output_dir) / "rollouts",
            rollout_fingerprint(self.train_dataset["prompt_ids"], self._rollout_generation_config),
        )
        self._rollouts = None
        self._rollout_round = None
        self._feature_cache = None
        if args.feature_cache_dir is not None:
            self._feature_cache = FeatureCache(
                args.feature_cache_dir,
                self.accelerator.unwrap_model(self.teacher_model),
                self.drafter.config.target_layer_ids,
                dtype=getattr(torch, args.feature_cache_dtype),
            )

    # ------------------------------------------------------------------ setup

    @staticmethod
    def _check_arguments(model, teacher_model, args, processing_class, train_dataset):
        if not isinstance(args, OPDConfig):
            raise TypeError(f"OPDTrainer needs an OPDConfig, got {type(args).__name__}")
        if isinstance(model, str) or isinstance(teacher_model, str) or teacher_model is None:
            raise TypeError(
                "OPDTrainer takes instantiated models: model=AdaFlashDrafter.from_pretrained(...), "
                "teacher_model=AutoModelForCausalLM.from_pretrained(...)"
            )
        if processing_class is None:
            raise ValueError("Pass processing_class=<the target's tokenizer>; the drafter has none of its own.")
        if not isinstance(train_dataset, Dataset):
            raise TypeError(
                f"train_dataset must be a datasets.Dataset (got {type(train_dataset).__name__}): rollouts are indexed "
                "by row, so streaming datasets are not supported; materialise it with Dataset.from_list or .take()"
            )
        drafter = _base_drafter(model)
        drafter.check_compatible(teacher_model)
        if args.block_size is not None and args.block_size != drafter.config.block_size:
            raise ValueError(
                f"args.block_size={args.block_size} differs from the drafter's block_size={drafter.config.block_size};"
                " leave block_size=None or build the drafter with the block size you want to train"
            )

    @staticmethod
    def _prepare_models(drafter, teacher_model, args, processing_class):
        # TRL prepares the teacher in evaluation mode but leaves its parameters trainable; without this, gradients
        # would reach the shared embeddings and output head.
        teacher_model.requires_grad_(False).eval()
        if drafter.length_head is not None and not args.train_length_head:
            drafter.length_head.requires_grad_(False)
        if processing_class.pad_token is None:
            processing_class.pad_token = processing_class.eos_token
        if getattr(drafter, "generation_config", None) is None:
            # TRL reads the student's generation config; the drafter never generates itself.
            drafter.generation_config = GenerationConfig(
                pad_token_id=processing_class.pad_token_id, eos_token_id=teacher_model.config.eos_token_id
            )

    @staticmethod
    def _encode_datasets(train_dataset, eval_dataset, args, processing_class):
        chat_template_kwargs = {"enable_thinking": args.enable_thinking, **(args.chat_template_kwargs or {})}
        check_columns(train_dataset)
        train_dataset = encode_dataset(train_dataset, processing_class, chat_template_kwargs)
        if eval_dataset is not None:
            if not is_offline(eval_dataset):
                raise ValueError(
                    "eval_dataset needs prompt/response pairs (`prompt` + `completion`/`response`): rollouts are only "
                    "generated for the training prompts. To evaluate a drafter on prompts, use "
                    "adaflash_hf.training.measure_acceptance."
                )
            eval_dataset = encode_dataset(eval_dataset, processing_class, chat_template_kwargs)
        return train_dataset, eval_dataset

    @property
    def drafter(self):
        """The `AdaFlashDrafter` under training (unwrapped from accelerate and PEFT)."""
        return _base_drafter(self.accelerator.unwrap_model(self.model))

    def _check_length_head_trainable(self):
        if not self.args.train_length_head or self.drafter.length_head is None:
            return
        if not any(p.requires_grad for p in self.drafter.length_head.parameters()):
            raise ValueError(
                "train_length_head=True but the length head is frozen (LoRA freezes every non-adapter weight). Add "
                f"modules_to_save=['{LENGTH_HEAD_PREFIX}'] to the LoraConfig, or set train_length_head=False."
            )

    def create_optimizer(self, model=None):
        """AdamW over the drafter at ``learning_rate`` and over the length head in its own group at
        ``length_head_learning_rate`` (docs/algorithm.md §4.10); weight decay applies to all, as in the reference."""
        if self.optimizer is None:
            named = [(n, p) for n, p in (model or self.model).named_parameters() if p.requires_grad]
            head = [p for n, p in named if LENGTH_HEAD_PREFIX in n]
            groups = [{"params": [p for n, p in named if LENGTH_HEAD_PREFIX not in n]}]
            if head:
                groups.append({"params": head, "lr": self.args.length_head_learning_rate})
            optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(self.args, model or self.model)
            optimizer_kwargs.setdefault("weight_decay", self.args.weight_decay)
            self.optimizer = optimizer_cls(groups, **optimizer_kwargs)
        return self.optimizer

    # ------------------------------------------------------------------ data

    def _generate_and_score_completions(self, inputs: list[dict]) -> dict[str, torch.Tensor]:
        """Turns dataset rows into a padded batch: ``input_ids``, ``attention_mask``, ``loss_mask`` ``[B, S]``."""
        pairs = [
            (row["prompt_ids"], row["completion_ids"] if "completion_ids" in row else self._rollout(row["row_index"]))
            for row in inputs
        ]
        batch = collate_sequences(pairs, self._tokenizer.pad_token_id, self.args.max_length)
        return {key: value.to(self.accelerator.device) for key, value in batch.items()}

    def _rollout(self, row_index: int) -> list[int]:
        return self._current_rollouts()[row_index]["completion_ids"]

    def _current_rollouts(self):
        """The rollouts of the current round (``global_step // rollout_refresh_steps``), loaded from the run's cache
        or generated by the target; the main process writes them, the others read them."""
        refresh = self.args.rollout_refresh_steps
        round_index = self.state.global_step // refresh if refresh > 0 else 0
        if round_index != self._rollout_round:
            with self.accelerator.main_process_first():
                self._rollouts = self._rollout_store.load_or_generate(round_index, self._generate_rollouts)
            self._rollout_round = round_index
        return self._rollouts

    def _generate_rollouts(self):
        prompts = self.train_dataset["prompt_ids"]
        teacher = self.accelerator.unwrap_model(self.teacher_model)
        drafter = self.accelerator.unwrap_model(self.model) if self.args.rollout_with_drafter else None
        was_training = drafter is not None and drafter.training
        if drafter is not None:
            drafter.eval()
        try:
            completions = generate_completions(
                teacher,
                prompts,
                self._rollout_generation_config,
                self._tokenizer.pad_token_id,
                batch_size=self.args.rollout_batch_size,
                assistant_model=drafter,
            )
        finally:
            if was_training:
                drafter.train()
        return Dataset.from_dict({"completion_ids": completions})

    # ------------------------------------------------------------------ loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        unwrapped = self.accelerator.unwrap_model(model)
        loss, metrics = self._forward_redirection(model, unwrapped, self._compute_loss, unwrapped, inputs)
        mode = "train" if self.model.training else "eval"
        for key, value in metrics.items():
            self._metrics[mode][key].append(self.accelerator.gather_for_metrics(value.reshape(1)).mean().item())
        return (loss, None) if return_outputs else loss

    def _compute_loss(self, student, inputs):
        """One micro-batch of docs/algorithm.md §4: target features, N anchors per row, one block-masked drafter
        forward, the drafting loss on the supervised slots, and the length-head loss on detached drafter states."""
        args, drafter = self.args, _base_drafter(student)
        config, target = drafter.config, self.accelerator.unwrap_model(self.teacher_model)
        input_ids, loss_mask = inputs["input_ids"], inputs["loss_mask"]
        if self._feature_cache is not None:
            features = self._feature_cache.features(input_ids, inputs["attention_mask"])
        else:
            features = target_features(target, input_ids, inputs["attention_mask"], config.target_layer_ids)
        layout = sample_anchors(loss_mask, config.block_size, args.num_anchors)
        output = draft_blocks(student, target, input_ids, features, layout)

        weights = block_loss_weights(loss_mask, layout, args.loss_decay_gamma).flatten(1)  # [B, Q]
        supervised = weights > 0
        data_labels, teacher_hidden = slot_targets(input_ids, features, layout)
        head = target.get_output_embeddings()
        draft_vocab, teacher = None, None
        if config.draft_vocab is not None:  # the student drafts over its reduced vocabulary, as at inference
            draft_vocab = self._draft_vocab_tensor(config.draft_vocab, head.weight.device)
            teacher = slot_teacher(features, layout)
            if teacher is not None:
                teacher = TeacherTop(teacher.argmax[supervised], teacher.logsumexp[supervised])
        selector = drafter.candidate_selector
        stats = row_statistics(
            output.last_hidden_state[supervised],
            teacher_hidden[supervised],
            data_labels[supervised],
            head.weight,
            head.bias,
            temperature=args.kl_temperature,
            chunk_size=args.loss_chunk_size,
            divergences=LOSS_DIVERGENCES[args.loss_type],
            checkpointing=args.loss_checkpointing,
            draft_vocab=draft_vocab,
            teacher=teacher,
            selector_top_k=0 if selector is None else selector.top_k,
        )
        loss, parts = drafting_loss(
            stats, weights[supervised], args.loss_type, args.alpha, args.clip_tau, args.clip_mode
        )
        if selector is not None:  # DFlash 2: the selector learns to rerank the student's top-K (speculators' loss)
            blocks = data_labels.view(*layout.anchors.shape, config.block_size)
            predecessors = torch.cat([blocks[..., :1], blocks[..., :-1]], dim=-1).flatten(1)  # the token before
            selector_part, selector_parts = selector_loss(
                selector, output.last_hidden_state[supervised], predecessors[supervised], stats, weights[supervised]
            )
            loss = loss + args.selector_loss_alpha * selector_part
            parts["selector"] = selector_parts.pop("selector_ce")

        # Leading run of drafter-argmax == data token per block: on greedy target data, greedy acceptance there.
        matches = torch.zeros_like(supervised)
        matches[supervised] = stats.student_argmax == data_labels[supervised]
        accepted = accepted_drafts(matches.view(*layout.anchors.shape, config.block_size))
        keep = layout.keep.float()
        metrics = {
            **{f"loss/{name}": value for name, value in parts.items()},
            "draft_accuracy": (stats.student_argmax == stats.teacher_argmax).float().mean(),
            "acceptance_length": ((accepted + 1) * keep).sum() / keep.sum(),
            # The loop crosses a stretch that accepts k - 1 drafts in about one step per k positions, so it weighs easy
            # stretches less than the anchor average above; counting a step per k positions is the harmonic mean, a
            # lower estimate of the loop's acceptance (docs/algorithm.md §4.12).
            "step_acceptance_length": keep.sum() / (keep / (accepted + 1)).sum(),
            "num_blocks": keep.sum(1).mean(),
        }
        if selector is not None:
            metrics[f"selector/recall_at_{selector.top_k}"] = selector_parts["recall"]
            metrics["selector/accuracy"] = selector_parts["accuracy"]
        if output.length_prediction is not None:
            confidence = torch.zeros_like(weights)
            confidence[supervised] = stats.student_max_prob
            labels = length_head_labels(
                accepted,
                config.block_size,
                args.length_head_lookahead,
                config.length_head_direct_len,
                confidence.view(*layout.anchors.shape, config.block_size),
            )
            head_loss, head_error = length_head_loss(
                output.length_prediction, labels, layout.keep, args.length_head_loss
            )
            metrics["length_head/mae"] = head_error
            if args.train_length_head:
                loss = loss + head_loss
                metrics["loss/length_head"] = head_loss.detach()
        return loss, metrics

    def _draft_vocab_tensor(self, ids: list[int], device) -> torch.Tensor:
        """The drafter's draft vocabulary as a tensor, built once per run (the config's list does not change)."""
        cached = getattr(self, "_draft_vocab_cache", None)
        if cached is None or cached[0] is not ids or cached[1].device != torch.device(device):
            cached = (ids, vocab_ids(ids, device))
            self._draft_vocab_cache = cached
        return cached[1]

    # ------------------------------------------------------------------ cards

    def create_model_card(self, model_name: str | None = None, dataset_name: str | None = None, tags=None, **kwargs):
        """Writes ``README.md`` into ``output_dir`` from the ``adaflash_hf/templates/drafter.md`` template (used at
        every save and by ``push_to_hub``)."""
        if not self.is_world_process_zero():
            return
        repo_id = self.args.hub_model_id or model_name or Path(self.args.output_dir).name
        recipe = (
            f"OPDTrainer, loss_type={self.args.loss_type}, alpha={self.args.alpha}, clip_tau={self.args.clip_tau} "
            f"({self.args.clip_mode}), num_anchors={self.args.num_anchors}, lr={self.args.learning_rate}"
        )
        acceptance = self._last_metric("acceptance_length")
        fields = drafter_card_fields(
            self.drafter,
            {
                "training_recipe": recipe,
                "acceptance": f"{acceptance:.2f} (teacher-forced, training data)" if acceptance is not None else None,
                "paper_title": self._paper["title"],
                "paper_id": self._paper["id"],
                "citation": self._paper["citation"],
            },
        )
        card = render_model_card("drafter", repo_id=repo_id, **fields)
        os.makedirs(self.args.output_dir, exist_ok=True)
        card.save(os.path.join(self.args.output_dir, "README.md"))

    def _last_metric(self, key: str) -> float | None:
        for entry in reversed(self.state.log_history):
            if key in entry:
                return entry[key]
        return None
