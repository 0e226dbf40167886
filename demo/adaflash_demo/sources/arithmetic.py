"""Generated GSM8K-style arithmetic word problems with computed answers.

Each problem follows one person's stock of an item through 3-4 operations (buy, give away, multiply, share
equally, sell); the solution shows every step as ``a op b = <<a op b=c>>c`` and ends with ``#### answer`` like
GSM8K. Answers are computed, never templated, so the target can learn real (small) arithmetic and the domain
has the highly predictable structure that makes long draft acceptance possible.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

NAMES = tuple(
    "Ava Ben Carla Dev Elena Farid Grace Hiro Ines Jamal Kofi Lena Mateo Nadia Omar Priya Quinn Rosa Sam "
    "Tara Uma Victor Wen Yusuf Zoe".split()
)
# Every item's plural is the singular plus "s", which keeps the templates simple.
ITEMS = tuple(
    "apple,marble,sticker,book,cookie,pencil,stamp,egg,card,shell,balloon,cupcake,toy car,seed packet".split(",")
)
CONTAINERS = ("boxes", "bags", "baskets", "jars", "crates", "shelves")


@dataclass
class _Story:
    """The running state of one problem: who, what, the current count, and the text written so far."""

    name: str
    friend: str
    singular: str
    plural: str
    count: int
    question: list[str]
    solution: list[str]

    def record(self, sentence: str, expression: str, result: int, explanation: str) -> None:
        self.question.append(sentence)
        self.solution.append(f"{explanation} {expression} = <<{expression}={result}>>{result} {self.plural}.")
        self.count = result


def _buy(story: _Story, rng: random.Random) -> None:
    amount = rng.randint(2, 40)
    story.record(
        f"{story.name} buys {amount} more {story.plural}.",
        f"{story.count}+{amount}",
        story.count + amount,
        "After buying more, there are",
    )


def _give(story: _Story, rng: random.Random) -> None:
    if story.count < 2:
        return _buy(story, rng)
    amount = rng.randint(1, story.count - 1)
    story.record(
        f"{story.name} gives {amount} {story.plural} to {story.friend}.",
        f"{story.count}-{amount}",
        story.count - amount,
        "After giving some away, there are",
    )


def _multiply(story: _Story, rng: random.Random) -> None:
    if story.count > 200:
        return _give(story, rng)
    factor = rng.randint(2, 4)
    story.record(
        f"Then the number of {story.plural} grows to {factor} times as many.",
        f"{story.count}*{factor}",
        story.count * factor,
        "Growing the pile gives",
    )


def _share(story: _Story, rng: random.Random) -> None:
    divisors = [d for d in range(2, 9) if story.count % d == 0 and story.count // d >= 2]
    if not divisors:
        return _buy(story, rng)
    parts = rng.choice(divisors)
    container = rng.choice(CONTAINERS)
    story.record(
        f"{story.name} packs the {story.plural} equally into {parts} {container} and keeps only one.",
        f"{story.count}/{parts}",
        story.count // parts,
        f"One of the {container} holds",
    )


_OPERATIONS = (_buy, _give, _multiply, _share)


def generate_problem(rng: random.Random) -> str:
    """One word problem with its step-by-step solution and ``#### answer`` line."""
    name, friend = rng.sample(NAMES, 2)
    singular = rng.choice(ITEMS)
    plural = singular + "s"
    start = rng.randint(3, 60)
    story = _Story(name, friend, singular, plural, start, [f"{name} has {start} {plural}."], [])
    for _ in range(rng.randint(3, 4)):
        rng.choice(_OPERATIONS)(story, rng)
    if rng.random() < 0.4:
        price = rng.randint(2, 9)
        story.question.append(
            f"Each {singular} sells for ${price}. How much money does {name} make selling all of them?"
        )
        answer = story.count * price
        story.solution.append(
            f"Selling them all makes {story.count}*{price} = <<{story.count}*{price}={answer}>>{answer} dollars."
        )
    else:
        story.question.append(f"How many {plural} does {name} have now?")
        answer = story.count
    return "Question: " + " ".join(story.question) + "\nAnswer: " + "\n".join(story.solution) + f"\n#### {answer}"
