"""The family matrix (`tests/family_matrix.py`) in CI: every run checks a rotating slice of the families (a sixth,
chosen by the date, or by ``ADAFLASH_MATRIX_SLICE``; families whose tiny model is slow to build stay out of it), with
linear and with tree verification, and with one verification kernel forced per family (the kernels rotate with the
slice); ``pytest -m slow tests/test_family_matrix.py`` checks them all.
Each family must give what `family_matrix.json` records, and the README's supported-families list is that record."""

import datetime
import os

import pytest
from family_matrix import (
    BEGIN,
    END,
    README,
    TREE_BUDGET,
    check_family,
    families,
    readme_section,
    recorded,
    recorded_kernels,
    recorded_seconds,
)

SLICES = 6
SLICE = int(os.environ.get("ADAFLASH_MATRIX_SLICE", datetime.date.today().toordinal() % SLICES))
MATRIX = {family: outcome for family, outcome in recorded().items() if not outcome.startswith("unbuildable")}
QUICK = (
    40.0  # seconds a family took in the sweep, in its own process (imports included; the sweep ran on a busy machine)
)


def in_this_run(index: int, family: str) -> bool:
    return index % SLICES == SLICE and recorded_seconds()[family] < QUICK


@pytest.mark.parametrize(
    "family",
    [
        pytest.param(family, marks=() if in_this_run(index, family) else pytest.mark.slow)
        for index, family in enumerate(sorted(MATRIX))
    ],
)
def test_each_family_is_exact_or_refused_clearly(family):
    outcome = check_family(family)
    assert outcome.startswith(("supported", "refused")), f"{family}: {outcome}"
    assert outcome == MATRIX[family], "the outcome changed: run `python tests/family_matrix.py --write`"


TREES = recorded(trees=True)


@pytest.mark.parametrize(
    "family",
    [
        pytest.param(family, marks=() if in_this_run(index, family) else pytest.mark.slow)
        for index, family in enumerate(sorted(TREES))
    ],
)
def test_each_family_is_exact_or_refused_clearly_with_trees(family):
    outcome = check_family(family, tree_budget=TREE_BUDGET)
    assert outcome.startswith(("supported", "refused")), f"{family}: {outcome}"
    assert outcome == TREES[family], "the outcome changed: run `python tests/family_matrix.py --write-trees`"


KERNEL_OUTCOMES = recorded_kernels()


@pytest.mark.parametrize(
    ("family", "kernel"),
    [
        pytest.param(
            family,
            kernel,
            marks=()
            if in_this_run(index, family) and kernel_index == (index // SLICES + SLICE) % len(KERNEL_OUTCOMES)
            else pytest.mark.slow,
        )
        for kernel_index, kernel in enumerate(KERNEL_OUTCOMES)
        for index, family in enumerate(sorted(MATRIX))
        if family in KERNEL_OUTCOMES[kernel]
    ],
)
def test_each_exact_family_stays_exact_with_each_kernel_forced(family, kernel):
    outcome = check_family(family, verify_layout=kernel)
    assert outcome == KERNEL_OUTCOMES[kernel][family] == "supported", f"{family} with {kernel}: {outcome}"


def test_the_record_covers_every_family_and_the_readme_lists_it():
    assert sorted(recorded()) == families(), (
        "transformers' families changed: run `python tests/family_matrix.py --write`"
    )
    exact = sorted(f for f, o in recorded().items() if o.startswith("supported"))
    assert sorted(TREES) == exact, "run `python tests/family_matrix.py --write-trees`"
    from adaflash_hf.generation.verify_layout import KERNELS

    assert {kernel: sorted(outcomes) for kernel, outcomes in KERNEL_OUTCOMES.items()} == dict.fromkeys(
        KERNELS, exact
    ), "run `python tests/family_matrix.py --write-kernels`"
    text = README.read_text()
    assert text[text.index(BEGIN) : text.index(END) + len(END)] == readme_section(recorded(), TREES)
