"""The drafter network against transformers' in-library DFlash drafter, and on transformers' native DFlash path."""

import pytest
import torch
from helpers import MASK_ID, tiny_drafter, tiny_target
from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel
from transformers.cache_utils import DFlashCache


def _muse_glimmer_twin(drafter):
    c = drafter.config
    config = MuseGlimmerAssistantConfig(
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps,
        rope_parameters=dict(c.rope_parameters),
        max_position_embeddings=c.max_position_embeddings,
        layer_types=list(c.layer_types),
        block_size=c.block_size,
        mask_token_id=c.mask_token_id,
        target_layer_ids=list(c.target_layer_ids),
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    twin = MuseGlimmerAssistantModel(config).eval()
    renamed = {
        key.replace("fc.", "encoder.fc.", 1)
        if key.startswith("fc.")
        else key.replace("hidden_norm.", "encoder.output_norm_enc.", 1)
        if key.startswith("hidden_norm.")
        else key: value
        for key, value in drafter.state_dict().items()
    }
    missing, unexpected = twin.load_state_dict(renamed, strict=False)
    assert not missing and not unexpected
    return twin


def _cached_steps(model, steps, block_size=8, hidden=64, width=128):
    """Runs the drafter like the generation loop does: new context rows + one block, then crop the block."""
    cache, outputs, start = DFlashCache(config=model.config), [], 0
    gen = torch.Generator().manual_seed(0)
    for new_context in steps:
        context = torch.randn(1, new_context, width, generator=gen)
        noise = torch.randn(1, block_size, hidden, generator=gen)
        positions = torch.arange(start, start + new_context + block_size)[None]
        cache.set_previous_accepted_tokens(new_context)
        outputs.append(
            model(
                noise_embeds=noise, context_hidden_states=context, position_ids=positions, cache=cache
            ).last_hidden_state
        )
        cache.crop(-block_size)
        start += new_context
    return outputs


def test_drafter_equals_transformers_dflash_drafter_on_identical_weights():
    drafter = tiny_drafter(tiny_target())
    twin = _muse_glimmer_twin(drafter)
    for ours, theirs in zip(_cached_steps(drafter, [7, 1, 3, 8]), _cached_steps(twin, [7, 1, 3, 8])):
        assert torch.allclose(ours, theirs, atol=1e-5)


def test_block_mask_training_forward_equals_cached_inference():
    """One forward over many blocks with a 4D mask equals per-block cached inference (the training view)."""
    drafter = tiny_drafter(tiny_target())
    seq, bs, anchors = 20, 8, [3, 9, 12]
    context = torch.randn(1, seq, 128)
    noise = torch.randn(1, len(anchors) * bs, 64)
    positions = torch.cat([torch.arange(seq)] + [torch.arange(a, a + bs) for a in anchors])[None]
    mask = torch.zeros(1, 1, len(anchors) * bs, seq + len(anchors) * bs, dtype=torch.bool)
    for n, a in enumerate(anchors):
        mask[0, 0, n * bs : (n + 1) * bs, :a] = True
        mask[0, 0, n * bs : (n + 1) * bs, seq + n * bs : seq + (n + 1) * bs] = True
    batched = drafter(noise_embeds=noise, context_hidden_states=context, position_ids=positions, attention_mask=mask)
    for n, a in enumerate(anchors):
        block = noise[:, n * bs : (n + 1) * bs]
        single = drafter(
            noise_embeds=block, context_hidden_states=context[:, :a], position_ids=torch.arange(a + bs)[None]
        )
        assert torch.allclose(batched.last_hidden_state[:, n * bs : (n + 1) * bs], single.last_hidden_state, atol=1e-5)


def test_eager_and_sdpa_agree_with_a_boolean_block_mask():
    drafter = tiny_drafter(tiny_target())
    mask = torch.rand(1, 1, 8, 13) > 0.3
    mask[..., 0] = True
    inputs = dict(
        noise_embeds=torch.randn(1, 8, 64), context_hidden_states=torch.randn(1, 5, 128), attention_mask=mask
    )
    sdpa = drafter(**inputs).last_hidden_state
    drafter.config._attn_implementation = "eager"
    assert torch.allclose(drafter(**inputs).last_hidden_state, sdpa, atol=1e-5)


def test_length_head_sees_detached_states_per_block():
    drafter = tiny_drafter(tiny_target(), use_length_head=True, length_head_bottleneck_dim=32)
    out = drafter(
        noise_embeds=torch.randn(2, 24, 64),
        context_hidden_states=torch.randn(2, 5, 128),
        attention_mask=torch.ones(2, 1, 24, 29, dtype=torch.bool),
    )
    assert out.length_prediction.shape == (2, 3)
    out.length_prediction.sum().backward()
    assert drafter.fc.weight.grad is None and drafter.length_head.down.weight.grad is not None


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_native_transformers_dflash_generation_with_our_drafter_is_lossless(family):
    target = tiny_target(family)
    drafter = tiny_drafter(target)
    prompt = torch.tensor([[0, 5, 9, 33, 17, 4, 80]])
    plain = target.generate(prompt, max_new_tokens=40, do_sample=False)
    native = target.generate(
        prompt, max_new_tokens=40, do_sample=False, assistant_model=drafter, speculation_type="dflash"
    )
    assert torch.equal(plain, native)
    assert MASK_ID == drafter.config.mask_token_id
