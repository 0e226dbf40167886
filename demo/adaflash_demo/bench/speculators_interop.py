"""Cross-checks our DFlash / DFlash 2 drafters against the `speculators` library's own classes, both directions.

speculators 0.9.0 pins an older transformers than this project, so it lives in an environment of its own and this
script runs in two interpreters, which exchange checkpoints and tensors through a work folder:

1. (project environment) our drafters, DFlash 2 and DFlash, with random weights (non-identity convolutions), saved with
   ``save_pretrained(..., save_format="speculators")``, plus fixed inputs (a block of embeddings, context features,
   positions, an LM head, an anchor token) and our outputs on them: the drafter's final hidden states and, for DFlash
   2, the selector's greedy path and its candidate scores at every slot.
2. (speculators environment) each of our checkpoints loaded with speculators' classes:
   ``SpeculatorModel.from_pretrained`` (which resolves the class from the config) and, for the strict check, the
   weights loaded into a model built from the config: no unexpected tensor, no missing one beyond those speculators
   itself fills from the verifier (``_keys_to_ignore_on_load_missing``). Its forward on the fixed inputs (``fc`` and
   ``hidden_norm`` on the context, the decoder layers with their convolutions, ``norm``; the selector's
   ``score_candidates`` along its greedy walk) must match ours. Then a speculators model with random weights saves a
   checkpoint of its own, with its outputs.
3. (project environment) each speculators checkpoint loaded with ``AdaFlashDrafter.from_pretrained`` (whose checks
   refuse any missing, unexpected or mis-shaped tensor) must reproduce speculators' outputs.

Usage (from the repository root; the speculators environment needs only ``pip install speculators==0.9.0``)::

    python demo/adaflash_demo/bench/speculators_interop.py --speculators-python VENV/bin/python --workdir DIR

It prints one line per check and exits non-zero if any fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

HIDDEN, VOCAB, BLOCK, CONTEXT, MASK_ID = 64, 128, 8, 11, 127
TARGET_LAYER_IDS = [0, 2]  # ours; speculators' aux_hidden_state_layer_ids are these + 1
TOLERANCE = 1e-5  # float32 everywhere; the two implementations order some sums differently
KINDS = ("dflash2", "dflash")
SELECTOR = dict(selector_rank=8, selector_top_k=4, conv_kernel_size=2, conv_group_size=16)


def _perturb(model: torch.nn.Module, seed: int) -> None:
    """Random weights everywhere (so the convolutions are not their identity initialisation)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters()):
            noise = torch.randn(parameter.shape, generator=generator) * 0.05
            parameter.copy_(noise + (1.0 if name.endswith("norm.weight") else 0.0))


def fixed_inputs() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)
    return {
        "noise": torch.randn(1, BLOCK, HIDDEN, generator=generator),
        "context": torch.randn(1, CONTEXT, len(TARGET_LAYER_IDS) * HIDDEN, generator=generator),
        "position_ids": torch.arange(CONTEXT + BLOCK)[None],
        "lm_head": torch.randn(VOCAB, HIDDEN, generator=generator) * 0.5,
        "anchor": torch.tensor([5]),
    }


def _save_tensors(path: Path, tensors: dict) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))


def _load_tensors(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


def _report(name: str, ok: bool, detail: str) -> bool:
    print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)
    return ok


def _close(name: str, ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    if ours.shape != theirs.shape:
        return _report(name, False, f"shapes differ: {tuple(ours.shape)} vs {tuple(theirs.shape)}")
    finite = torch.isfinite(ours) & torch.isfinite(theirs)
    same_inf = torch.equal(torch.isfinite(ours), torch.isfinite(theirs))
    error = (ours[finite] - theirs[finite]).abs().max().item() if finite.any() else 0.0
    return _report(name, same_inf and error <= TOLERANCE, f"max |difference| {error:.2e} (tolerance {TOLERANCE:g})")


# ---------------------------------------------------------------------------------------------- project side


def _our_outputs(drafter, inputs: dict) -> dict[str, torch.Tensor]:
    from adaflash_hf.dflash2 import walk_selector

    with torch.no_grad():
        hidden = drafter(
            noise_embeds=inputs["noise"],
            context_hidden_states=inputs["context"],
            position_ids=inputs["position_ids"],
        ).last_hidden_state
        out = {"hidden": hidden}
        if drafter.candidate_selector is not None:
            unary = hidden[:, 1:] @ inputs["lm_head"].T
            tokens, scores = walk_selector(drafter.candidate_selector, hidden[:, 1:], unary, inputs["anchor"], None)
            out.update(path=tokens, scores=scores)
    return out


def _our_drafter(kind: str):
    from adaflash_hf import AdaFlashConfig, AdaFlashDrafter

    config = AdaFlashConfig(
        hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=VOCAB, mask_token_id=MASK_ID, block_size=BLOCK, target_layer_ids=TARGET_LAYER_IDS,
        num_target_layers=4, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, drafter_type=kind,
        **(SELECTOR if kind == "dflash2" else {}),
    )  # fmt: skip
    drafter = AdaFlashDrafter(config).eval()
    _perturb(drafter, seed=7)
    return drafter


def project_save(workdir: Path) -> None:
    inputs = fixed_inputs()
    _save_tensors(workdir / "inputs.safetensors", inputs)
    for kind in KINDS:
        drafter = _our_drafter(kind)
        drafter.save_pretrained(workdir / f"ours-{kind}", save_format="speculators")
        _save_tensors(workdir / f"ours-{kind}-outputs.safetensors", _our_outputs(drafter, inputs))
        print(f"saved our {kind} drafter with save_format='speculators' to {workdir / f'ours-{kind}'}", flush=True)


def project_check(workdir: Path) -> bool:
    from adaflash_hf import AdaFlashDrafter

    inputs, ok = _load_tensors(workdir / "inputs.safetensors"), True
    for kind in KINDS:
        drafter = AdaFlashDrafter.from_pretrained(workdir / f"theirs-{kind}").eval()
        ok &= _report(
            f"speculators {kind} checkpoint -> AdaFlashDrafter.from_pretrained",
            drafter.config.drafter_type == kind and drafter.config.target_layer_ids == TARGET_LAYER_IDS,
            f"drafter_type={drafter.config.drafter_type}, target_layer_ids={drafter.config.target_layer_ids}, "
            f"{len(drafter.state_dict())} tensors, none missing or unexpected (checked by from_pretrained)",
        )
        ours, theirs = _our_outputs(drafter, inputs), _load_tensors(workdir / f"theirs-{kind}-outputs.safetensors")
        ok &= _close(
            f"{kind}: our forward of speculators' checkpoint vs speculators' forward", ours["hidden"], theirs["hidden"]
        )
        if kind == "dflash2":
            same = torch.equal(ours["path"], theirs["path"])
            ok &= _report(
                f"{kind}: selector greedy path", same, f"ours {ours['path'].tolist()} vs {theirs['path'].tolist()}"
            )
            ok &= _close(f"{kind}: selector candidate scores along the path", ours["scores"], theirs["scores"])
            # negative control: without its convolutions the drafter must not match, or the check could not see them
            for layer in drafter.layers:
                layer.attention_conv.reset_parameters()
                layer.mlp_conv.reset_parameters()
            error = (_our_outputs(drafter, inputs)["hidden"] - theirs["hidden"]).abs().max().item()
            ok &= _report(
                f"{kind}: control, convolutions reset to identity",
                error > 100 * TOLERANCE,
                f"max |difference| {error:.2e} (must exceed {100 * TOLERANCE:g})",
            )
    return ok


# ---------------------------------------------------------------------------------------------- speculators side


def _their_outputs(model, inputs: dict) -> dict[str, torch.Tensor]:
    """speculators' backbone on one block (every block row sees the whole context and its block, as at inference)
    and, for DFlash 2, the greedy walk of its `CandidateSelector.score_candidates`."""
    with torch.no_grad():
        context = model.hidden_norm(model.fc(inputs["context"]))
        embeddings = model.rotary_emb(inputs["noise"], inputs["position_ids"])
        hidden = inputs["noise"]
        for layer in model.layers:
            hidden = layer(
                hidden_states=hidden,
                target_hidden=context,
                attention_mask=None,
                position_ids=inputs["position_ids"],
                position_embeddings=embeddings,
            )
        hidden = model.norm(hidden)
        out = {"hidden": hidden}
        selector = getattr(model, "candidate_selector", None)
        if selector is not None:
            drafts = hidden[:, 1:]
            unary = drafts @ inputs["lm_head"].T
            candidates = unary.topk(selector.top_k, dim=-1).indices
            previous, path, scores = inputs["anchor"], [], torch.full_like(unary, float("-inf"))
            for i in range(drafts.shape[1]):
                slot = selector.score_candidates(unary[:, i], drafts[:, i], previous, candidates[:, i])
                previous = candidates[:, i].gather(-1, slot.argmax(-1, keepdim=True)).squeeze(-1)
                path.append(previous)
                scores[:, i].scatter_(-1, candidates[:, i], slot)
            out.update(path=torch.stack(path, dim=1), scores=scores)
    return out


def _strict_load(model_class, path: Path) -> tuple[bool, str]:
    """Our checkpoint's tensors against a speculators model built from its config: nothing unexpected, nothing
    missing beyond what speculators fills from the verifier itself."""
    from safetensors.torch import load_file
    from speculators import SpeculatorModelConfig

    config = SpeculatorModelConfig.from_pretrained(str(path))
    config.transformer_layer_config._attn_implementation = "eager"
    model = model_class(config)
    missing, unexpected = model.load_state_dict(load_file(str(path / "model.safetensors")), strict=False)
    allowed = set(model._keys_to_ignore_on_load_missing)
    problems = sorted(set(missing) - allowed)
    ok = not unexpected and not problems
    detail = f"unexpected {unexpected}, missing {problems} (verifier-owned, filled by speculators: {sorted(missing)})"
    return ok, detail


def speculators_side(workdir: Path) -> bool:
    from importlib.metadata import version

    from speculators import SpeculatorModel
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
    from speculators.models.dflash2 import DFlash2DraftModel, DFlash2SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import Qwen3Config

    print(f"speculators {version('speculators')}, transformers {version('transformers')}, torch {torch.__version__}")
    inputs, ok = _load_tensors(workdir / "inputs.safetensors"), True
    classes = {
        "dflash2": (DFlash2DraftModel, DFlash2SpeculatorConfig),
        "dflash": (DFlashDraftModel, DFlashSpeculatorConfig),
    }
    for kind in KINDS:
        model_class, config_class = classes[kind]
        path = workdir / f"ours-{kind}"
        strict, detail = _strict_load(model_class, path)
        ok &= _report(f"our {kind} checkpoint -> speculators {model_class.__name__} (strict)", strict, detail)
        loaded = SpeculatorModel.from_pretrained(str(path))
        ok &= _report(
            f"our {kind} checkpoint -> SpeculatorModel.from_pretrained",
            type(loaded) is model_class,
            f"resolved {type(loaded).__name__}",
        )
        loaded.config.transformer_layer_config._attn_implementation = "eager"
        loaded.eval()
        ours, theirs = _load_tensors(workdir / f"ours-{kind}-outputs.safetensors"), _their_outputs(loaded, inputs)
        ok &= _close(
            f"{kind}: speculators' forward of our checkpoint vs our forward", theirs["hidden"], ours["hidden"]
        )
        if kind == "dflash2":
            same = torch.equal(theirs["path"], ours["path"])
            ok &= _report(
                f"{kind}: selector greedy path",
                same,
                f"speculators {theirs['path'].tolist()} vs ours {ours['path'].tolist()}",
            )
            ok &= _close(f"{kind}: selector candidate scores along the path", theirs["scores"], ours["scores"])

        # a checkpoint of speculators' own making
        layers = Qwen3Config(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rope_theta=1_000_000.0,
        )  # fmt: skip
        layers._attn_implementation = "eager"
        proposals = [GreedyTokenProposalConfig(speculative_tokens=BLOCK - 1)]
        verifier = VerifierConfig(name_or_path=None, architectures=["Qwen3ForCausalLM"])
        config = config_class(
            transformer_layer_config=layers,
            draft_vocab_size=VOCAB,
            block_size=BLOCK,
            aux_hidden_state_layer_ids=[i + 1 for i in TARGET_LAYER_IDS],
            mask_token_id=MASK_ID,
            speculators_config=SpeculatorsConfig(
                algorithm=kind, proposal_methods=proposals, default_proposal_method="greedy", verifier=verifier
            ),
            **({k: v for k, v in SELECTOR.items()} if kind == "dflash2" else {}),
        )
        model = model_class(config).eval()
        _perturb(model, seed=11)
        model.save_pretrained(str(workdir / f"theirs-{kind}"))
        _save_tensors(workdir / f"theirs-{kind}-outputs.safetensors", _their_outputs(model, inputs))
        print(f"saved a speculators {kind} checkpoint to {workdir / f'theirs-{kind}'}", flush=True)
    return ok


# ---------------------------------------------------------------------------------------------- driver


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--speculators-python", help="python of the environment with speculators==0.9.0")
    parser.add_argument("--side", choices=("speculators",), help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.side == "speculators":
        return 0 if speculators_side(args.workdir) else 1
    if not args.speculators_python:
        parser.error("--speculators-python is required")
    project_save(args.workdir)
    env = {**os.environ, "PYTHONPATH": ""}  # the speculators side must not import this project (nor its transformers)
    side = subprocess.run(
        [args.speculators_python, __file__, "--side", "speculators", "--workdir", str(args.workdir)], env=env
    )
    ok = _report("speculators side", side.returncode == 0, f"exit status {side.returncode}")
    if all((args.workdir / f"theirs-{kind}" / "config.json").exists() for kind in KINDS):
        ok &= project_check(args.workdir)
    print(json.dumps({"all_passed": bool(ok)}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
