"""Training DFlash 2 drafters with OPDTrainer: the drafting loss plus speculators' selector loss over the top-K."""

import pytest
import torch
from datasets import Dataset
from synthetic import opd_args, prompts, synthetic_drafter

from adaflash_hf import AdaFlashConfig, AdaFlashDrafter
from adaflash_hf.dflash2 import CandidateSelector, training_candidates
from adaflash_hf.training import OPDTrainer
from adaflash_hf.training.losses import row_statistics, selector_loss

TOP_K = 4


def _train(target, tokenizer, drafter, tmp_path, steps):
    args = opd_args(tmp_path, max_steps=steps, logging_steps=2, learning_rate=3e-3)
    trainer = OPDTrainer(
        model=drafter,
        teacher_model=target,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts(32)}),
        processing_class=tokenizer,
    )
    trainer.train()
    return [entry for entry in trainer.state.log_history if "loss" in entry]


def test_training_from_scratch_lowers_the_loss_and_raises_the_selector_recall(target, tokenizer, tmp_path):
    torch.manual_seed(3)
    config = AdaFlashConfig.from_target_config(
        target.config,
        num_hidden_layers=1,
        block_size=8,
        mask_token_id=tokenizer.mask_token_id,
        target_layer_ids=[0, 1],
        drafter_type="dflash2",
        selector_rank=16,
        selector_top_k=TOP_K,
    )
    drafter = AdaFlashDrafter(config)
    selector_before = drafter.candidate_selector.successor_codebook.detach().clone()
    conv_before = drafter.layers[0].mlp_conv.kernel_projection.weight.detach().clone()
    logs = _train(target, tokenizer, drafter, tmp_path, steps=30)
    recall = [entry[f"selector/recall_at_{TOP_K}"] for entry in logs]
    selector = [entry["loss/selector"] for entry in logs]
    print(f"loss {logs[0]['loss']:.3f} -> {logs[-1]['loss']:.3f}, recall@{TOP_K} {recall[0]:.3f} -> {recall[-1]:.3f}")
    assert logs[-1]["loss"] < logs[0]["loss"]
    assert selector[-1] < selector[0]
    assert recall[-1] > recall[0] + 0.2
    assert all("selector/accuracy" in entry for entry in logs)
    # the selector and the convolutions learn (the convolutions start as identities)
    assert not torch.equal(drafter.candidate_selector.successor_codebook.detach(), selector_before)
    assert not torch.equal(drafter.layers[0].mlp_conv.kernel_projection.weight.detach(), conv_before)


def test_training_from_a_dflash_drafter_and_saving_for_the_engines(target, tokenizer, tmp_path):
    torch.manual_seed(4)
    v1 = synthetic_drafter(target, tokenizer)
    _train(target, tokenizer, v1, tmp_path / "v1", steps=6)
    drafter = v1.to_dflash2(selector_rank=16, selector_top_k=TOP_K)
    logs = _train(target, tokenizer, drafter, tmp_path / "v2", steps=12)
    assert logs[-1]["loss"] < logs[0]["loss"]
    assert logs[-1][f"selector/recall_at_{TOP_K}"] >= logs[0][f"selector/recall_at_{TOP_K}"]
    drafter.save_pretrained(tmp_path / "speculators", save_format="speculators")
    reloaded = AdaFlashDrafter.from_pretrained(tmp_path / "speculators")
    assert reloaded.config.drafter_type == "dflash2"
    assert all(torch.equal(v, reloaded.state_dict()[k]) for k, v in drafter.state_dict().items())


# ------------------------------------------------------------------ the loss as a pure function


def test_training_candidates_inject_the_missing_target_at_rank_k():
    top = torch.tensor([[5, 9, 2, 7], [5, 9, 2, 7]])
    candidates, labels, recall = training_candidates(top, torch.tensor([2, 11]))
    assert candidates.tolist() == [[5, 9, 2, 7], [5, 9, 2, 11]]
    assert labels.tolist() == [2, 3] and recall.tolist() == [True, False]


def test_selector_loss_is_the_k_way_cross_entropy_and_reaches_both_parts():
    torch.manual_seed(0)
    vocab, hidden_size, rows = 20, 8, 6
    head = torch.randn(vocab, hidden_size)
    selector = CandidateSelector(vocab, hidden_size, rank=4, top_k=TOP_K)
    torch.nn.init.normal_(selector.predecessor_codebook)
    torch.nn.init.normal_(selector.successor_codebook)
    student = torch.randn(rows, hidden_size, requires_grad=True)
    teacher = torch.randn(rows, hidden_size)
    labels = torch.randint(vocab, (rows,))
    stats = row_statistics(student, teacher, labels, head, selector_top_k=TOP_K, checkpointing=False)
    predecessors = torch.randint(vocab, (rows,))
    weights = torch.rand(rows)
    loss, parts = selector_loss(selector, student, predecessors, stats, weights)

    # by hand: top-K of the student's logits, the teacher's argmax injected, CE over unary + transition
    logits = student @ head.T
    targets = (teacher @ head.T).argmax(-1)
    expected = []
    for i in range(rows):
        ids = logits[i].topk(TOP_K).indices.tolist()
        if int(targets[i]) not in ids:
            ids[-1] = int(targets[i])
        context = selector.predecessor_codebook[predecessors[i]] * selector.hidden_projection(student[i])
        scores = logits[i, ids] + (context * selector.successor_codebook[ids]).sum(-1)
        expected.append(torch.nn.functional.cross_entropy(scores[None], torch.tensor([ids.index(int(targets[i]))])))
    expected = (torch.stack(expected) * weights).sum() / (weights.sum() + 1e-6)
    torch.testing.assert_close(loss, expected)
    recall = sum(int(targets[i]) in logits[i].topk(TOP_K).indices.tolist() for i in range(rows)) / rows
    assert parts["recall"].item() == pytest.approx(recall)
    loss.backward()
    assert student.grad.abs().sum() > 0 and selector.successor_codebook.grad.abs().sum() > 0


def test_selector_candidates_need_the_whole_vocabulary():
    with pytest.raises(ValueError, match="no draft_vocab"):
        row_statistics(
            torch.randn(2, 8), torch.randn(2, 8), torch.tensor([1, 2]), torch.randn(20, 8),
            draft_vocab=torch.tensor([1, 2, 3]), selector_top_k=2,
        )  # fmt: skip
