"""One request as the target reads it: the single place where a prompt meets the chat template.

Serving and training must render a prompt identically: a drafter learns the target's features on the token
sequences its training rendered, so a prompt served with another template call (another system turn, a thinking
block, a duplicated BOS) is drafted on inputs it never saw. Everything that turns a user's text or a conversation
into the target's input calls `render_prompt`: the `adaflash` command, the demo, the demo recipe's prompt builder
and `OPDTrainer`'s rollouts.
"""

from __future__ import annotations

# `OPDConfig.enable_thinking` defaults to False, so drafters train on non-thinking turns; serving renders the same.
DEFAULT_ENABLE_THINKING = False


def render_prompt(
    tokenizer,
    prompt: str | list[dict],
    *,
    tokenize: bool = False,
    enable_thinking: bool = DEFAULT_ENABLE_THINKING,
    **chat_template_kwargs,
) -> str | list[int]:
    """The target's input for one request, ending where the assistant's answer starts.

    Args:
        tokenizer: the target's tokenizer.
        prompt: the user's text (one user turn), or a conversation (``[{"role": ..., "content": ...}, ...]``).
        tokenize: return token ids instead of text. The rendered text already holds the template's special tokens,
            so it is tokenized without adding them again (a second BOS on Llama templates).
        enable_thinking: passed to templates that read it (Qwen3's); others ignore it.
        chat_template_kwargs: further variables of the template.

    A tokenizer without a chat template (a base model) continues the user's text as it is, tokenized with its own
    special tokens; a conversation needs a template and raises otherwise.
    """
    if tokenizer.chat_template is None:
        if not isinstance(prompt, str):
            raise ValueError(
                "this tokenizer has no chat template, so it cannot render a conversation: give the prompt as plain "
                "text, or use a tokenizer with a chat template (e.g. the instruct model's)"
            )
        return tokenizer(prompt)["input_ids"] if tokenize else prompt
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=enable_thinking, **chat_template_kwargs
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"] if tokenize else text
