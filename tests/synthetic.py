"""A deterministic synthetic language on which a tiny target and a drafter learn in seconds.

A sentence is ``step<k> n<x> n<x+k> n<x+2k> ...`` (numbers mod `MODULUS`): the step token fixes the stride, so the
continuation is fully determined by the prompt ``step<k> n<x>``. The target learns it exactly; a drafter then
needs the stride (from the target features) and the anchor token to draft a whole block.
"""

import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from adaflash_hf import AdaFlashConfig, AdaFlashDrafter

MODULUS = 24
STEPS = (1, 2, 3, 5)
SPECIALS = ["<pad>", "<eos>", "<mask>"]
VOCAB = SPECIALS + [f"step{k}" for k in STEPS] + [f"n{i}" for i in range(MODULUS)]
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def synthetic_tokenizer() -> PreTrainedTokenizerFast:
    model = WordLevel({word: i for i, word in enumerate(VOCAB)}, unk_token="<pad>")
    backend = Tokenizer(model)
    backend.pre_tokenizer = WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", mask_token="<mask>", unk_token="<pad>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def sentence(step: int, start: int, length: int) -> str:
    return " ".join([f"step{step}"] + [f"n{(start + i * step) % MODULUS}" for i in range(length)])


def prompts(count: int, seed: int = 0) -> list[str]:
    gen = torch.Generator().manual_seed(seed)
    steps = torch.randint(len(STEPS), (count,), generator=gen).tolist()
    starts = torch.randint(MODULUS, (count,), generator=gen).tolist()
    return [sentence(STEPS[s], x, 1) for s, x in zip(steps, starts)]


def train_target(tokenizer, num_steps: int = 300, length: int = 40, seed: int = 0):
    """A 2-layer Qwen3 trained to continue synthetic sentences exactly (a few seconds on CPU)."""
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=len(VOCAB),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    target = Qwen3ForCausalLM(config)
    optimizer = torch.optim.AdamW(target.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed)
    step_ids = torch.tensor([tokenizer.convert_tokens_to_ids(f"step{k}") for k in STEPS])
    first_number = tokenizer.convert_tokens_to_ids("n0")
    for _ in range(num_steps):
        which = torch.randint(len(STEPS), (32,), generator=gen)
        starts = torch.randint(MODULUS, (32, 1), generator=gen)
        numbers = (starts + torch.arange(length) * torch.tensor(STEPS)[which].unsqueeze(1)) % MODULUS
        ids = torch.cat([step_ids[which].unsqueeze(1), numbers + first_number], dim=1)
        loss = target(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return target.eval()


def synthetic_drafter(
    target, tokenizer, block_size: int = 8, use_length_head: bool = False, seed: int = 1, draft_vocab=None
):
    torch.manual_seed(seed)
    config = AdaFlashConfig.from_target_config(
        target.config,
        num_hidden_layers=1,
        block_size=block_size,
        mask_token_id=tokenizer.mask_token_id,
        target_layer_ids=[0, 1],
        use_length_head=use_length_head,
        length_head_bottleneck_dim=32,
        draft_vocab=draft_vocab,
    )
    return AdaFlashDrafter(config)


def opd_args(output_dir, **overrides):
    """An `OPDConfig` for seconds-long CPU runs on the synthetic language."""
    from adaflash_hf.training import OPDConfig

    defaults = dict(
        output_dir=str(output_dir),
        max_steps=10,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=1,
        learning_rate=3e-3,
        bf16=False,
        use_cpu=True,
        logging_steps=5,
        save_strategy="no",
        report_to=[],
        max_completion_length=32,
        num_anchors=64,
        disable_tqdm=True,
        seed=0,
    )
    return OPDConfig(**{**defaults, **overrides})
