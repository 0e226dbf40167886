"""Block layout and losses of OPD training on fixed tensors, against direct (brute-force) formulas."""

import pytest
import torch
import torch.nn.functional as F

from adaflash_hf.training.blocks import (
    BlockLayout,
    block_attention_mask,
    block_loss_weights,
    block_noise_ids,
    block_position_ids,
    block_supervised_mask,
    sample_anchors,
)
from adaflash_hf.training.losses import (
    accepted_drafts,
    clipped_reverse_kl,
    drafting_loss,
    length_head_labels,
    length_head_loss,
    row_statistics,
)

MASK = 99


def _loss_mask(prompt_lengths, lengths, width):
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, (p, n) in enumerate(zip(prompt_lengths, lengths)):
        mask[row, p:n] = 1
    return mask


# ---------------------------------------------------------------- anchors, mask, positions, weights


def test_anchors_are_distinct_sorted_response_positions_with_the_reference_count():
    loss_mask = _loss_mask([5, 3], [30, 12], 30)
    layout = sample_anchors(loss_mask, block_size=4, num_anchors=100)
    # candidates: row 0 positions 5..26 (22), row 1 positions 3..11 (9); N = min(100, 22 - 1)
    assert layout.num_blocks == 21
    assert layout.keep.sum(1).tolist() == [21, 9]
    for row in range(2):
        kept = layout.anchors[row][layout.keep[row]]
        assert torch.equal(kept, kept.sort().values) and len(set(kept.tolist())) == len(kept)
        assert bool((loss_mask[row, kept] == 1).all()) and bool((kept <= 30 - 4).all())
    assert layout.anchors[1, ~layout.keep[1]].eq(0).all()
    assert sample_anchors(loss_mask, 4, num_anchors=3).num_blocks == 3


def test_anchor_sampling_rejects_sequences_without_room_for_a_block():
    with pytest.raises(ValueError, match="at least 2 response tokens"):
        sample_anchors(_loss_mask([10], [11], 20), block_size=4, num_anchors=8)
    with pytest.raises(ValueError, match="too short"):
        sample_anchors(_loss_mask([1], [4], 4), block_size=4, num_anchors=8)


def test_attention_mask_equals_brute_force_construction():
    seq, bs = 12, 3
    layout = BlockLayout(
        anchors=torch.tensor([[2, 5, 9], [4, 0, 0]]),
        keep=torch.tensor([[True, True, True], [True, False, False]]),
        block_size=bs,
    )
    mask = block_attention_mask(seq, layout)
    assert mask.shape == (2, 1, 9, seq + 9) and mask.dtype == torch.bool
    for b in range(2):
        for q in range(9):
            n = q // bs
            for j in range(seq + 9):
                if j < seq:
                    expected = bool(layout.keep[b, n]) and j < int(layout.anchors[b, n])
                else:
                    expected = bool(layout.keep[b, n]) and (j - seq) // bs == n
                assert bool(mask[b, 0, q, j]) == expected, (b, q, j)


def test_noise_ids_and_positions():
    input_ids = torch.arange(10, 22).unsqueeze(0)
    layout = BlockLayout(anchors=torch.tensor([[3, 7]]), keep=torch.tensor([[True, True]]), block_size=3)
    assert block_noise_ids(input_ids, layout, MASK).tolist() == [[13, MASK, MASK, 17, MASK, MASK]]
    assert block_position_ids(12, layout).tolist() == [list(range(12)) + [3, 4, 5, 7, 8, 9]]
    dropped = BlockLayout(anchors=torch.tensor([[3, 0]]), keep=torch.tensor([[True, False]]), block_size=3)
    assert block_noise_ids(input_ids, dropped, MASK).tolist() == [[13, MASK, MASK, MASK, MASK, MASK]]


def test_weights_exclude_anchor_slot_prompt_padding_and_dropped_blocks_and_decay():
    # prompt 0..3, response 4..8, padding 9..11
    loss_mask = _loss_mask([4], [9], 12)
    layout = BlockLayout(anchors=torch.tensor([[4, 7, 0]]), keep=torch.tensor([[True, True, False]]), block_size=4)
    weights = block_loss_weights(loss_mask, layout, decay_gamma=7.0)
    supervised = block_supervised_mask(loss_mask, layout)
    assert supervised[0].tolist() == [
        [False, True, True, True],  # slots 5, 6, 7: response; slot 0 is the anchor
        [False, True, False, False],  # slot 8 is response; 9 and 10 are padding
        [False, False, False, False],  # dropped block
    ]
    decay = torch.exp(-torch.tensor([0.0, 0.0, 1.0, 2.0]) / 7.0)
    assert torch.allclose(weights[0, 0], decay * torch.tensor([0.0, 1, 1, 1]))
    assert torch.equal(block_loss_weights(loss_mask, layout, None), supervised.float())


# ---------------------------------------------------------------- losses


def _rows(m=7, h=8, v=11, seed=0):
    gen = torch.Generator().manual_seed(seed)
    student = torch.randn(m, h, generator=gen, requires_grad=True)
    teacher = torch.randn(m, h, generator=gen)
    weight, bias = torch.randn(v, h, generator=gen), torch.randn(v, generator=gen)
    labels = torch.randint(v, (m,), generator=gen)
    return student, teacher, weight, bias, labels


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_row_statistics_equal_direct_formulas_and_chunking_is_exact(temperature):
    student, teacher, weight, bias, labels = _rows()
    stats = row_statistics(student, teacher, labels, weight, bias, temperature=temperature, chunk_size=3)
    zs, zt = F.linear(student, weight, bias), F.linear(teacher, weight, bias)
    ls, lt = F.log_softmax(zs / temperature, -1), F.log_softmax(zt / temperature, -1)
    t2 = temperature**2
    assert torch.allclose(stats.reverse_kl, t2 * (ls.exp() * (ls - lt)).sum(-1), atol=1e-5)
    assert torch.allclose(stats.forward_kl, t2 * (lt.exp() * (lt - ls)).sum(-1), atol=1e-5)
    assert torch.equal(stats.teacher_argmax, zt.argmax(-1))
    assert torch.allclose(stats.ce_teacher, F.cross_entropy(zs, zt.argmax(-1), reduction="none"), atol=1e-5)
    assert torch.allclose(stats.ce_data, F.cross_entropy(zs, labels, reduction="none"), atol=1e-5)
    # Chunked + checkpointed gradients equal one unchunked pass.
    (stats.reverse_kl.sum() + stats.ce_teacher.sum()).backward()
    chunked = student.grad.clone()
    student.grad = None
    full = row_statistics(student, teacher, labels, weight, bias, temperature=temperature, chunk_size=1000)
    (full.reverse_kl.sum() + full.ce_teacher.sum()).backward()
    assert torch.allclose(chunked, student.grad, atol=1e-5)


@pytest.mark.parametrize("loss_type", ["opd", "ce", "fkl"])
def test_only_the_divergences_a_loss_reads_are_computed_and_the_loss_is_unchanged(loss_type):
    from adaflash_hf.training.losses import LOSS_DIVERGENCES

    student, teacher, weight, bias, labels = _rows()
    w = torch.rand(7, generator=torch.Generator().manual_seed(1))
    full = row_statistics(student, teacher, labels, weight, bias)
    reference, _ = drafting_loss(full, w, loss_type)
    (reference_grad,) = torch.autograd.grad(reference, student)
    needed = LOSS_DIVERGENCES[loss_type]
    for checkpointing in (True, False):
        lean = row_statistics(
            student, teacher, labels, weight, bias, chunk_size=3, divergences=needed, checkpointing=checkpointing
        )
        loss, _ = drafting_loss(lean, w, loss_type)
        (grad,) = torch.autograd.grad(loss, student)
        assert torch.allclose(loss, reference, atol=1e-6) and torch.allclose(grad, reference_grad, atol=1e-6)
        for name in {"forward_kl", "reverse_kl"} - set(needed):
            assert not getattr(lean, name).any()  # not computed


def test_ce_target_of_opd_is_the_teacher_argmax_not_the_data_token():
    student, teacher, weight, bias, _ = _rows()
    teacher_argmax = F.linear(teacher, weight, bias).argmax(-1)
    data = (teacher_argmax + 1) % weight.shape[0]  # every data token differs from the teacher's choice
    stats = row_statistics(student, teacher, data, weight, bias)
    w = torch.rand(7)
    loss, parts = drafting_loss(stats, w, "opd", alpha=1.0)
    expected = (w * F.cross_entropy(F.linear(student, weight, bias), teacher_argmax, reduction="none")).sum()
    assert torch.allclose(loss, expected / (w.sum() + 1e-6), atol=1e-5)
    ce_loss, _ = drafting_loss(stats, w, "ce")
    assert not torch.allclose(ce_loss, loss)
    assert torch.allclose(ce_loss, (w * stats.ce_data).sum() / (w.sum() + 1e-6))


def test_clipped_reverse_kl_equals_direct_formula_in_both_modes():
    kl = torch.tensor([0.001, 0.5, 2.0, 30.0, 0.2])
    w = torch.tensor([1.0, 0.5, 1.0, 0.25, 0.0])
    norm = w.sum() + 1e-6
    tau = 0.3
    loss, clipped = clipped_reverse_kl(kl, w, tau, "reference")
    assert torch.allclose(loss, (w * torch.minimum(kl / norm, torch.tensor(tau))).sum())
    assert clipped.tolist() == [False, False, True, True, False]  # 2/2.75 and 30/2.75 exceed 0.3; the last has w=0
    loss, clipped = clipped_reverse_kl(kl, w, tau, "per_token")
    assert torch.allclose(loss, (w * torch.minimum(kl, torch.tensor(tau))).sum() / norm)
    assert clipped.tolist() == [False, True, True, True, False]
    for mode in ("reference", "per_token"):
        unclipped, none = clipped_reverse_kl(kl, w, None, mode)
        assert torch.allclose(unclipped, (w * kl).sum() / norm) and not none.any()


@pytest.mark.parametrize("mode", ["reference", "per_token"])
def test_clipped_rows_get_zero_gradient(mode):
    kl = torch.tensor([0.01, 0.5, 2.0, 30.0], requires_grad=True)
    w = torch.ones(4)
    loss, clipped = clipped_reverse_kl(kl, w, 0.3, mode)
    loss.backward()
    assert clipped.any() and (~clipped).any()
    assert torch.all(kl.grad[clipped] == 0)
    assert torch.all(kl.grad[~clipped] > 0)


def test_opd_loss_mixes_ce_and_clipped_rkl_and_reports_the_clip_ratio():
    student, teacher, weight, bias, labels = _rows()
    stats = row_statistics(student, teacher, labels, weight, bias)
    w = torch.tensor([1.0, 1, 1, 1, 0.5, 0.5, 0])
    loss, parts = drafting_loss(stats, w, "opd", alpha=0.8, clip_tau=0.05, clip_mode="reference")
    rkl, clipped = clipped_reverse_kl(stats.reverse_kl, w, 0.05, "reference")
    ce = (w * stats.ce_teacher).sum() / (w.sum() + 1e-6)
    assert torch.allclose(loss, 0.8 * ce + 0.2 * rkl)
    assert parts["clip_ratio"] == clipped.sum() / 6
    fkl, _ = drafting_loss(stats, w, "fkl")
    assert torch.allclose(fkl, (w * stats.forward_kl).sum() / (w.sum() + 1e-6))
    with pytest.raises(ValueError, match="loss_type"):
        drafting_loss(stats, w, "jsd")


def test_accepted_drafts_and_length_head_labels():
    matches = torch.tensor(
        [[True, True, True, False, True], [False, False, True, True, True], [False, True, True, True, True]]
    )
    accepted = accepted_drafts(matches)
    assert accepted.tolist() == [2, 0, 4]  # slot 0 (the anchor) never counts
    assert torch.allclose(length_head_labels(accepted, 5, lookahead=1), torch.tensor([3 / 5, 1 / 5, 1.0]))
    confidence = torch.tensor([[1.0, 0.9, 0.8, 0.5, 0.5]] * 3)
    labels = length_head_labels(accepted, 5, lookahead=1, direct_len=False, draft_confidence=confidence)
    # idx = clamp(accepted + 1, 0, 3): row 0 -> cum[3] = .9*.8*.5*.5, row 1 -> cum[1] = .9*.8, row 2 all accepted
    assert torch.allclose(labels, torch.tensor([1 - 0.9 * 0.8 * 0.5 * 0.5, 1 - 0.9 * 0.8, 1.0]))
    pred = torch.tensor([[0.5, 0.2, 0.9]], requires_grad=True)
    loss, mae = length_head_loss(pred, torch.tensor([[0.6, 0.2, 0.1]]), torch.tensor([[True, True, False]]))
    assert torch.allclose(loss, torch.tensor(0.01 / 2), atol=1e-6) and torch.allclose(mae, torch.tensor(0.05))


def test_row_statistics_of_no_rows_give_a_zero_loss_with_a_gradient_path():
    student, teacher, weight, bias, labels = _rows()
    stats = row_statistics(student[:0], teacher[:0], labels[:0], weight, bias)
    loss, _ = drafting_loss(stats, torch.zeros(0), "opd")
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(student.grad, torch.zeros_like(student))


def test_row_statistics_cast_drafter_states_to_the_heads_dtype():
    student, teacher, weight, bias, labels = _rows()
    stats = row_statistics(student, teacher.bfloat16(), labels, weight.bfloat16(), bias.bfloat16())
    assert stats.reverse_kl.dtype == torch.float32 and torch.isfinite(stats.reverse_kl).all()


# ---------------------------------------------------------------- reduced draft vocabulary


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("stored_teacher", [False, True])
def test_draft_vocabulary_statistics_equal_the_restricted_direct_formulas(temperature, stored_teacher):
    from adaflash_hf.training.losses import teacher_top

    student, teacher, weight, bias, labels = _rows(m=9, v=13)
    vocab = torch.tensor([0, 2, 3, 5, 8, 9, 12])
    zt = F.linear(teacher, weight, bias)
    labels[0] = zt[0].argmax()  # at least one reachable and one unreachable label
    labels[1] = 1
    top = teacher_top(teacher, weight, bias) if stored_teacher else None
    stats = row_statistics(
        student, teacher, labels, weight, bias, temperature=temperature, chunk_size=4, draft_vocab=vocab, teacher=top
    )
    zs = F.linear(student, weight[vocab], bias[vocab])  # the student is a distribution over the draft vocabulary
    ls = F.log_softmax(zs / temperature, -1)
    lt_full = F.log_softmax(zt / temperature, -1)  # the teacher over the whole vocabulary
    lt = lt_full[:, vocab]
    t2 = temperature**2
    # reverse KL is exact: the student has no mass outside the draft vocabulary
    assert torch.allclose(stats.reverse_kl, t2 * (ls.exp() * (ls - lt)).sum(-1), atol=1e-5)
    assert torch.allclose(stats.forward_kl, t2 * (lt.exp() * (lt - ls)).sum(-1), atol=1e-5)
    assert torch.equal(stats.teacher_argmax, zt.argmax(-1))  # target token ids, whole vocabulary
    assert torch.equal(stats.student_argmax, vocab[zs.argmax(-1)])
    position = {int(t): i for i, t in enumerate(vocab)}
    raw = F.log_softmax(zs, -1)
    for row in range(9):
        for got, label in ((stats.ce_data[row], int(labels[row])), (stats.ce_teacher[row], int(zt[row].argmax()))):
            expected = -raw[row, position[label]] if label in position else torch.tensor(0.0)
            assert torch.allclose(got, expected, atol=1e-5)
    assert stats.ce_data[1] == 0  # label 1 is outside the draft vocabulary
    (stats.reverse_kl.sum() + stats.ce_teacher.sum()).backward()
    assert torch.isfinite(student.grad).all() and student.grad.abs().sum() > 0


def test_draft_vocabulary_of_every_token_equals_the_plain_statistics():
    student, teacher, weight, bias, labels = _rows()
    plain = row_statistics(student, teacher, labels, weight, bias)
    full = row_statistics(student, teacher, labels, weight, bias, draft_vocab=torch.arange(weight.shape[0]))
    for name in ("ce_teacher", "ce_data", "forward_kl", "reverse_kl", "student_max_prob"):
        assert torch.allclose(getattr(plain, name), getattr(full, name), atol=1e-5), name
    assert torch.equal(plain.student_argmax, full.student_argmax)
