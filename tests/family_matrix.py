"""The family matrix: every decoder-only causal-LM family transformers builds tiny from its config, against AdaFlash.

Each family is built with `tiny_target` (its default config, shrunk), given a drafter from
`AdaFlashConfig.from_target_config`, and generates greedily at batch 1 and at batch 3 with left padding, with a
random and an oracle drafter (rejections at varying drafts). The outcome is one of:

* ``supported``: every output equals plain generate()'s;
* ``refused: <message>``: generate(assistant_model=...) raised one clear error before generating;
* ``unbuildable: <reason>``: plain generate() itself fails on the tiny config (not a case for AdaFlash);
* ``wrong`` or ``crash: <error>``: a bug, which `tests/test_family_matrix.py` fails on.

`family_matrix.json` records the outcomes; `python tests/family_matrix.py --write` sweeps every family again (one
process each, with a timeout), rewrites it and the supported-families list in README.md (`--write FAMILY...`
re-sweeps only those). `--write-trees` does the same with tree verification (`TREE_BUDGET`) over the families exact
with linear verification, recorded beside the linear outcomes and listed under them in README.md. `--write-kernels`
sweeps the families exact with linear verification once per verification kernel forced
(``adaflash_verify_layout``, `adaflash_hf.generation.verify_layout.KERNELS`): a kernel sums the same products in
another order, so this is where a flipped near-tie would show (docs/algorithm.md §3.8).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

RECORD = Path(__file__).with_name("family_matrix.json")
README = Path(__file__).parents[1] / "README.md"
BEGIN, END = "<!-- family-matrix:begin -->", "<!-- family-matrix:end -->"
PROMPTS = [[0, 5, 9, 33, 17, 4, 80], [0, 44], [0, 7, 7, 7, 101, 3, 9, 12, 5]]
PAD = 2
NEW_TOKENS = 17
MAX_PARAMETERS = 20_000_000


def families() -> list[str]:
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = []
    for family in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            if not AutoConfig.for_model(family).is_encoder_decoder:
                names.append(family)
        except Exception:  # configs that need arguments are not buildable from defaults
            continue
    return names


def _parameters_on_meta(family: str) -> int:
    """Parameters of the family's tiny model, counted without allocating it."""
    import torch
    from helpers import tiny_config
    from transformers import AutoModelForCausalLM

    config = tiny_config(family)
    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(config)
        except ValueError:  # no sdpa path; the count does not depend on it
            config._attn_implementation = "eager"
            model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def _first_line(error: BaseException) -> str:
    # rstrip: `write` reads outcomes back from a child's stripped stdout, so a cut that ends on a space must not
    # keep it, or the record and a fresh check differ by that space.
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300].rstrip()


def check_family(family: str, tree_budget: int | None = None, verify_layout: str | None = None) -> str:
    """Runs the matrix for one family and returns its outcome (see the module docstring); with `tree_budget`, the
    speculative calls verify draft trees of that many tokens (``adaflash_tree_budget``); with `verify_layout`, every
    verification forward runs that kernel (``adaflash_verify_layout``)."""
    import torch
    from helpers import oracle_drafter, tiny_drafter, tiny_target
    from transformers import GenerationConfig

    def left_pad(prompts):
        width = max(map(len, prompts))
        ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        return ids, mask

    try:
        size = _parameters_on_meta(family)
        if size > MAX_PARAMETERS:  # sub-configs the shrinking does not reach (vision towers, ...): not tiny
            return f"unbuildable: {size / 1e6:.0f}M parameters once shrunk"
        target = tiny_target(family)
    except Exception as error:
        return "unbuildable: " + _first_line(error)
    inputs = [left_pad(PROMPTS[:1]), left_pad(PROMPTS)]
    kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=PAD)
    references = []
    for ids, mask in inputs:
        try:
            references.append(target.generate(ids, attention_mask=mask, **kwargs))
        except Exception as error:
            if not references:
                return "unbuildable: " + _first_line(error)
            references.append(None)  # plain generate() fails at batch 3: only batch 1 is compared
    try:
        drafter = tiny_drafter(target)
    except ValueError as error:  # a clear error: the config lacks what a drafter needs (attention heads, ...)
        return "refused: " + _first_line(error)
    except Exception as error:
        return "crash: from_target_config: " + _first_line(error)
    for (ids, mask), reference in zip(inputs, references):
        if reference is None:
            continue
        width = ids.shape[1]
        rows = [row[width - len(p) :].tolist() for row, p in zip(reference, PROMPTS)]
        try:
            oracles = [oracle_drafter(target, rows, corrupt=lambda row, anchor: {1 + (row + anchor) % 7})]
        except AssertionError:  # output heads the oracle cannot steer (e.g. tied and rescaled): random drafts only
            oracles = []
        # the AdaFlash options ride on a config of their own; the call's keywords override its fields as in the
        # references
        options = {"adaflash_tree_budget": tree_budget, "adaflash_verify_layout": verify_layout}
        options = {name: value for name, value in options.items() if value is not None}
        config = {"generation_config": GenerationConfig(**options)} if options else {}
        for candidate in [drafter, *oracles]:
            try:
                out = target.generate(ids, attention_mask=mask, assistant_model=candidate, **config, **kwargs)
            except (ValueError, NotImplementedError) as error:
                return "refused: " + _first_line(error)
            except Exception as error:
                return "crash: " + _first_line(error)
            if not torch.equal(out, reference):
                return "wrong"
    return "supported" if all(r is not None for r in references) else "supported (batch 1; plain fails at batch 3)"


TREE_BUDGET = 16  # the tree matrix's adaflash_tree_budget


def recorded(trees: bool = False) -> dict[str, str]:
    """The recorded outcomes of linear verification, or of tree verification (`TREE_BUDGET`) with `trees`."""
    return json.loads(RECORD.read_text())["tree_outcomes" if trees else "outcomes"]


def recorded_kernels() -> dict[str, dict[str, str]]:
    """The recorded outcomes per verification kernel forced (``{kernel: {family: outcome}}``)."""
    return json.loads(RECORD.read_text()).get("kernel_outcomes", {})


def recorded_seconds() -> dict[str, float]:
    """Seconds each family took in the sweep (one process each, imports included)."""
    return json.loads(RECORD.read_text())["seconds"]


def _reason(message: str) -> str:
    """A refusal's message, short: the model class named generically (families refused alike share a line), the
    lower-case parentheticals dropped, the first sentence kept."""
    message = re.sub(r"\b\w+(ForCausalLM|LMHeadModel|Decoder)\b", "the target", message)
    message = re.sub(r" \([a-z][^()]*\)", "", message.removeprefix("ValueError: "))
    return re.split(r"\.\s+(?=[A-Z])", message)[0].rstrip(".") + "."


def readme_section(outcomes: dict[str, str], trees: dict[str, str] | None = None) -> str:
    supported = [f for f, o in outcomes.items() if o.startswith("supported")]
    refused: dict[str, list[str]] = {}
    for family, outcome in outcomes.items():
        if outcome.startswith("refused"):
            refused.setdefault(_reason(outcome.removeprefix("refused: ")), []).append(family)
    other = [f for f, o in outcomes.items() if not o.startswith(("supported", "refused"))]
    lines = [
        BEGIN,
        f"Generated by `python tests/family_matrix.py --write`: of the {len(outcomes)} decoder-only causal-LM "
        f"families of transformers, the {len(outcomes) - len(other)} that build tiny from their default configs, "
        "with a drafter from `AdaFlashConfig.from_target_config`, greedy, at batch 1 and at batch 3 with left "
        "padding, random and oracle drafters.",
        "",
        f"**Exact ({len(supported)}):** " + ", ".join(f"`{f}`" for f in supported) + ".",
        "",
        f"**Refused with a clear error ({sum(map(len, refused.values()))}):**",
        "",
    ]
    lines += [f"- {', '.join(f'`{f}`' for f in families)}: {reason}" for reason, families in refused.items()]
    lines += ["", f"**Not buildable tiny from their default config ({len(other)}):** "]
    lines[-1] += ", ".join(f"`{f}`" for f in other) + "."
    if trees:
        lines += ["", *tree_lines(trees)]
    return "\n".join(lines + [END])


def tree_lines(trees: dict[str, str]) -> list[str]:
    """The tree verification record (`python tests/family_matrix.py --write-trees`), for the exact families."""
    exact = [f for f, o in trees.items() if o.startswith("supported")]
    refused: dict[str, list[str]] = {}
    for family, outcome in trees.items():
        if outcome.startswith("refused"):
            refused.setdefault(_reason(outcome.removeprefix("refused: ")), []).append(family)
    other = [f for f, o in trees.items() if not o.startswith(("supported", "refused"))]
    lines = [
        f"**With tree verification** (`adaflash_tree_budget={TREE_BUDGET}`, the same calls; generated by `python "
        f"tests/family_matrix.py --write-trees` over the {len(trees)} families exact above): exact on {len(exact)}, "
        f"refused with a clear error on {sum(map(len, refused.values()))}"
        + (f", other outcomes on {len(other)}: " + ", ".join(f"`{f}` ({trees[f]})" for f in other) if other else "")
        + ".",
        "",
    ]
    lines += [f"- {', '.join(f'`{f}`' for f in families)}: {reason}" for reason, families in refused.items()]
    return lines


def _sweep(sweep: list[str], flags: list[str], timeout: float) -> tuple[dict[str, str], dict[str, float]]:
    """Each family's outcome and seconds, one process each (`flags` before the family on its command line)."""
    outcomes, seconds = {}, {}
    for family in sweep:
        start = time.monotonic()
        try:
            done = subprocess.run(
                [sys.executable, __file__, *flags, family],
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
            lines = done.stdout.strip().splitlines()
            if lines:
                outcomes[family] = lines[-1]
            elif done.returncode < 0:  # killed by a signal while building: the default config is too big to build
                outcomes[family] = f"unbuildable: killed by signal {-done.returncode} (out of memory)"
            else:
                outcomes[family] = "crash: " + done.stderr.strip()[-200:]
        except subprocess.TimeoutExpired:
            outcomes[family] = f"unbuildable: no result within {timeout:.0f} s"
        seconds[family] = round(time.monotonic() - start, 1)
        print(f"{family} ({seconds[family]} s): {outcomes[family]}", flush=True)
    return outcomes, seconds


def write(only: list[str] | None = None, timeout: float = 120.0, trees: bool = False) -> dict[str, str]:
    """Sweeps every family (or re-sweeps those in `only`, keeping the others' record) and rewrites the record and
    the README list. With `trees`, the tree verification record, over the families exact with linear verification."""
    record = json.loads(RECORD.read_text()) if RECORD.exists() else {}
    key, seconds_key = ("tree_outcomes", "tree_seconds") if trees else ("outcomes", "seconds")
    outcomes, seconds = ({}, {}) if not only else (record.get(key, {}), record.get(seconds_key, {}))
    if trees:
        sweep = only or [f for f, o in recorded().items() if o.startswith("supported")]
    else:
        sweep = only or families()
    new_outcomes, new_seconds = _sweep(sweep, ["--tree"] if trees else [], timeout)
    outcomes.update(new_outcomes)
    seconds.update(new_seconds)
    record.update({key: outcomes, seconds_key: seconds})
    RECORD.write_text(json.dumps(record, indent=1) + "\n")
    update_readme(record["outcomes"], record.get("tree_outcomes"))
    return outcomes


def write_kernels(kernels: list[str], timeout: float = 120.0) -> dict[str, dict[str, str]]:
    """Sweeps the families exact with linear verification once per kernel in `kernels` (every kernel when empty),
    each forced, and records the outcomes beside the others."""
    from adaflash_hf.generation.verify_layout import KERNELS

    record = json.loads(RECORD.read_text())
    exact = [f for f, o in recorded().items() if o.startswith("supported")]
    outcomes = record.setdefault("kernel_outcomes", {})
    for kernel in kernels or list(KERNELS):
        outcomes[kernel] = _sweep(exact, ["--kernel", kernel], timeout)[0]
        RECORD.write_text(json.dumps(record, indent=1) + "\n")
    return outcomes


def update_readme(outcomes: dict[str, str], trees: dict[str, str] | None = None) -> None:
    text = README.read_text()
    section = readme_section(outcomes, trees)
    README.write_text(re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: section, text, flags=re.S))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # as under pytest (conftest.py): the tiny models' runtime profiles stay in memory, out of the user's cache
    os.environ.setdefault("ADAFLASH_HF_PROFILE_DIR", "none")
    import torch
    import transformers

    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    if sys.argv[1:2] == ["--write"]:
        write(sys.argv[2:])
    elif sys.argv[1:2] == ["--write-trees"]:
        write(sys.argv[2:], trees=True)
    elif sys.argv[1:] == ["--readme"]:
        record = json.loads(RECORD.read_text())
        update_readme(record["outcomes"], record.get("tree_outcomes"))
    elif sys.argv[1:2] == ["--write-kernels"]:
        write_kernels(sys.argv[2:])
    elif sys.argv[1:2] == ["--kernel"]:
        print(check_family(sys.argv[3], verify_layout=sys.argv[2]))
    elif sys.argv[1:2] == ["--tree"]:
        print(check_family(sys.argv[2], tree_budget=TREE_BUDGET))
    else:
        print(check_family(sys.argv[1]))
