"""Synthetic reasoning tasks whose difficulty is a knob, each with an independent solver.

Four families, all generated in code (no data files, same problems on every machine):

``chains`` (multi-hop variable chains; difficulty = hops)::

    4>t;7>Q;t>b;Q>m;b>c;?c    ->  4

    Read ``x>y`` as "y takes the value of x". Several chains are interleaved (each definition
    after the one it refers to); the query ``?c`` names the last variable of one chain, `hops`
    references away from its digit, and its answer follows. The format is chosen for attention:
    a defined name sees its source two tokens back, and a reference (``b`` in ``b>c``, ``c`` in
    ``?c``) is the very token of the definition it needs, so "find the earlier definition of the
    token I am, take its value" is one content match on the current token, for references and
    the query alike. Resolving h hops needs h sequential lookups, so a model that runs its
    recurrent core longer can follow longer chains. The other chains are distractors with
    distinct root digits, so guessing from the context scores about 1 / num_chains.

``modsum`` (the sum of a string of digits modulo 10; difficulty = number of digits)::

    39417=   ->  4

    Every running sum depends on the one before it: n dependent additions. A causal model can
    carry the running sum one position further per layer (each digit adds itself to its left
    neighbour's running sum, a fixed-offset lookup that attention learns easily), so answering
    takes depth proportional to n, and a recurrent core run longer handles longer strings.
    Guessing scores 10%.

``shells`` (the shell game; difficulty = number of swaps)::

    2>abdcab=   ->  1

    A ball starts under cup 2 of five; each letter swaps two neighbouring cups (a: 0-1, b: 1-2,
    c: 2-3, d: 3-4), and the answer is the cup the ball ends under. Swaps of neighbouring cups
    generate the symmetric group S5, whose word problem has no constant-depth shortcut (it is
    NC1-complete, unlike the running sum modulo 10 that counting solves in a few layers), so a
    model must carry the ball's cup from swap to swap: depth grows with the number of swaps.
    Guessing scores about 20%.

``addition`` (multi-digit addition, most significant digit first; difficulty = digits)::

    0472+0839=   ->  01311

    Fixed-width, zero-padded operands and sum; the first answer digit depends on the whole
    carry chain, which a causal model must resolve before it writes anything.

`Problem.prompt` is what the model reads and `Problem.answer` the continuation it must produce;
`task.solve(prompt)` recomputes the answer from the prompt text alone (the tests compare the two).
"""

from __future__ import annotations

import itertools
import random
import re
import string
from dataclasses import asdict, dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class Problem:
    task: str
    difficulty: int
    prompt: str
    answer: str

    @property
    def text(self) -> str:
        return self.prompt + self.answer

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "text": self.text}


class ReasoningTask:
    """A problem family: `sample(rng, difficulty)` draws one problem, `solve(prompt)` answers it."""

    name: ClassVar[str]
    difficulty_name: ClassVar[str]
    min_difficulty: ClassVar[int]
    max_difficulty: ClassVar[int]

    def sample(self, rng: random.Random, difficulty: int) -> Problem:
        raise NotImplementedError

    def solve(self, prompt: str) -> str:
        raise NotImplementedError

    def training_segments(
        self, rng: random.Random, difficulty: int, intermediate: bool = False
    ) -> list[tuple[str, bool | str]]:
        """A training row as (text, label) pieces: label False (not scored), True (predict the text)
        or a string of the same length (predict it instead of the text). By default the prompt,
        then the supervised answer. `intermediate` asks for extra supervision where a task has it."""
        problem = self.sample(rng, difficulty)
        return [(problem.prompt, False), (problem.answer, True)]

    @staticmethod
    def stepwise_segments(prefix: str, steps: str, states: list[int]) -> list[tuple[str, bool | str]]:
        """Segments of `prefix + steps + "="` then the answer, where each step token also predicts the
        state after it (states[k] after steps[k]; the last one is the answer), never shown in the text."""
        labels = "".join(map(str, states))  # the label of token k + 1 is the state after step k
        return [(prefix + steps[0], False), (steps[1:] + "=", labels), (str(states[-1]), True)]

    def check_difficulty(self, difficulty: int) -> None:
        if isinstance(difficulty, bool) or not isinstance(difficulty, int) or not (
            self.min_difficulty <= difficulty <= self.max_difficulty
        ):
            raise ValueError(
                f"{self.name}: {self.difficulty_name}={difficulty!r} is invalid: expected an integer in "
                f"[{self.min_difficulty}, {self.max_difficulty}]"
            )

    def alphabet(self) -> str:
        """Every character a prompt or answer of this task can contain."""
        raise NotImplementedError

    def chance(self) -> float | None:
        """Accuracy of the best guess that ignores the reasoning (None when negligible)."""
        return None


class VariableChains(ReasoningTask):
    """Multi-hop variable chains with distractors (see the module docstring)."""

    name = "chains"
    difficulty_name = "hops"
    min_difficulty = 0
    NAMES = string.ascii_letters  # 52 one-character variable names

    def __init__(self, num_chains: int = 4, distractor_hops: int | None = None) -> None:
        if isinstance(num_chains, bool) or not isinstance(num_chains, int) or not 1 <= num_chains <= 10:
            raise ValueError(f"num_chains={num_chains!r} is invalid: expected an integer in [1, 10] (distinct digits)")
        if distractor_hops is not None and (not isinstance(distractor_hops, int) or distractor_hops < 0):
            raise ValueError(f"distractor_hops={distractor_hops!r} is invalid: expected None or an integer >= 0")
        self.num_chains = num_chains
        self.distractor_hops = distractor_hops

    @property
    def max_difficulty(self) -> int:  # type: ignore[override]
        # Every chain of h hops uses h + 1 names; distractors may be as long as the target.
        return len(self.NAMES) // self.num_chains - 1

    def _chains(
        self, rng: random.Random, difficulty: int
    ) -> tuple[list[tuple[str, str]], list[list[tuple[str, str, int]]]]:
        """The interleaved definitions as (text, value), and per chain its variables as
        (name, root digit, hops from the root). Chain 0 is the target; its last variable is
        `difficulty` hops from its digit.
        """
        self.check_difficulty(difficulty)
        longest = difficulty if self.distractor_hops is None else min(self.distractor_hops, self.max_difficulty)
        lengths = [difficulty] + [rng.randint(0, longest) for _ in range(self.num_chains - 1)]
        names = rng.sample(self.NAMES, sum(n + 1 for n in lengths))
        roots = rng.sample(string.digits, self.num_chains)
        chains: list[list[str]] = []
        for hops, root in zip(lengths, roots):
            own, names = names[: hops + 1], names[hops + 1 :]
            chains.append([f"{root}>{own[0]};"] + [f"{own[i - 1]}>{own[i]};" for i in range(1, hops + 1)])
        # A uniformly random interleaving that keeps each chain in order.
        slots = [c for c, chain in enumerate(chains) for _ in chain]
        rng.shuffle(slots)
        cursor = [0] * len(chains)
        parts = []
        for c in slots:
            parts.append((chains[c][cursor[c]], roots[c]))
            cursor[c] += 1
        variables = [
            [(text[2], root, depth) for depth, text in enumerate(chain)] for chain, root in zip(chains, roots)
        ]
        return parts, variables

    def sample(self, rng: random.Random, difficulty: int) -> Problem:
        definitions, chains = self._chains(rng, difficulty)
        name, root, _ = chains[0][-1]
        return Problem(self.name, difficulty, "".join(t for t, _ in definitions) + f"?{name}", root)

    def training_segments(
        self, rng: random.Random, difficulty: int, intermediate: bool = False
    ) -> list[tuple[str, bool | str]]:
        """The evaluation problem; with `intermediate`, every reference is supervised too.

        A reference `a` in `a>b;` then predicts the value of `a` (the label of the following '>'
        is that digit), exactly as the query `?c` predicts its answer: the lookup the query needs,
        supervised at every reference. It leaks nothing: the labels never appear in the text.
        (Several queries per row would leak: their answers are distinct root digits, so the last
        one follows by elimination; two queries on one chain give each other away.)
        """
        definitions, chains = self._chains(rng, difficulty)
        segments: list[tuple[str, bool | str]] = []
        for text, value in definitions:
            if intermediate and text[0].isalpha():
                segments += [(text[0], False), (">", value), (text[2:], False)]
            else:
                segments.append((text, False))
        name, root, _ = chains[0][-1]
        return segments + [(f"?{name}", False), (root, True)]

    _DEF = re.compile(r"([A-Za-z0-9])>([A-Za-z]);")
    _QUERY = re.compile(r"\?([A-Za-z])$")

    def solve(self, prompt: str) -> str:
        """Read the definitions in order and follow references from the queried name to a digit."""
        query = self._QUERY.search(prompt)
        if query is None:
            raise ValueError(f"chains: no query '?x' at the end of {prompt!r}")
        env = {target: source for source, target in self._DEF.findall(prompt[: query.start()])}
        value, seen = query.group(1), set()
        while value.isalpha():
            if value in seen or value not in env:
                raise ValueError(f"chains: {value!r} is undefined or circular in {prompt!r}")
            seen.add(value)
            value = env[value]
        return value

    def alphabet(self) -> str:
        return self.NAMES + string.digits + ">;?"

    def chance(self) -> float:
        return 1 / self.num_chains  # guessing one of the root digits in the context


class Addition(ReasoningTask):
    """Zero-padded multi-digit addition, answer most significant digit first."""

    name = "addition"
    difficulty_name = "digits"
    min_difficulty = 1
    max_difficulty = 40

    def sample(self, rng: random.Random, difficulty: int) -> Problem:
        self.check_difficulty(difficulty)
        a, b = rng.randrange(10**difficulty), rng.randrange(10**difficulty)
        prompt = f"{a:0{difficulty}d}+{b:0{difficulty}d}="
        return Problem(self.name, difficulty, prompt, f"{a + b:0{difficulty + 1}d}")

    _PROMPT = re.compile(r"^(\d+)\+(\d+)=$")

    def solve(self, prompt: str) -> str:
        match = self._PROMPT.match(prompt)
        if match is None or len(match.group(1)) != len(match.group(2)):
            raise ValueError(f"addition: expected 'A+B=' with equal-width operands, got {prompt!r}")
        width = len(match.group(1)) + 1
        return str(int(match.group(1)) + int(match.group(2))).zfill(width)

    def alphabet(self) -> str:
        return string.digits + "+="


class RunningSum(ReasoningTask):
    """The sum of n digits modulo 10: a chain of n dependent additions (see the module docstring)."""

    name = "modsum"
    difficulty_name = "digits"
    min_difficulty = 1
    max_difficulty = 200

    def sample(self, rng: random.Random, difficulty: int) -> Problem:
        self.check_difficulty(difficulty)
        digits = "".join(rng.choice(string.digits) for _ in range(difficulty))
        return Problem(self.name, difficulty, digits + "=", str(sum(map(int, digits)) % 10))

    def training_segments(
        self, rng: random.Random, difficulty: int, intermediate: bool = False
    ) -> list[tuple[str, bool | str]]:
        """With `intermediate`, each digit also predicts the running sum so far (mod 10) instead of
        the next digit: the step the answer needs, supervised at every position (never in the text).
        """
        problem = self.sample(rng, difficulty)
        if not intermediate:
            return [(problem.prompt, False), (problem.answer, True)]
        digits = problem.prompt[:-1]
        return self.stepwise_segments("", digits, [total % 10 for total in itertools.accumulate(map(int, digits))])

    _PROMPT = re.compile(r"^(\d+)=$")

    def solve(self, prompt: str) -> str:
        match = self._PROMPT.match(prompt)
        if match is None:
            raise ValueError(f"modsum: expected digits followed by '=', got {prompt!r}")
        total = 0
        for ch in match.group(1):
            total = (total + int(ch)) % 10
        return str(total)

    def alphabet(self) -> str:
        return string.digits + "="

    def chance(self) -> float:
        return 0.1  # one digit of ten


class ShellGame(ReasoningTask):
    """Where is the ball? Five cups; each letter swaps two neighbouring cups (see the module docstring)."""

    name = "shells"
    difficulty_name = "swaps"
    min_difficulty = 1
    max_difficulty = 200
    SWAPS: ClassVar[dict[str, tuple[int, int]]] = {"a": (0, 1), "b": (1, 2), "c": (2, 3), "d": (3, 4)}

    @classmethod
    def _after(cls, cup: int, letter: str) -> int:
        left, right = cls.SWAPS[letter]
        return right if cup == left else left if cup == right else cup

    def _positions(self, start: int, letters: str) -> list[int]:
        """The ball's cup after each swap."""
        cups, cup = [], start
        for letter in letters:
            cup = self._after(cup, letter)
            cups.append(cup)
        return cups

    def _draw(self, rng: random.Random, difficulty: int) -> tuple[int, str]:
        self.check_difficulty(difficulty)
        return rng.randrange(5), "".join(rng.choice("abcd") for _ in range(difficulty))

    def sample(self, rng: random.Random, difficulty: int) -> Problem:
        start, letters = self._draw(rng, difficulty)
        return Problem(self.name, difficulty, f"{start}>{letters}=", str(self._positions(start, letters)[-1]))

    def training_segments(
        self, rng: random.Random, difficulty: int, intermediate: bool = False
    ) -> list[tuple[str, bool | str]]:
        """With `intermediate`, each swap also predicts the ball's cup after it (never in the text)."""
        start, letters = self._draw(rng, difficulty)
        cups = self._positions(start, letters)
        if not intermediate:
            return [(f"{start}>{letters}=", False), (str(cups[-1]), True)]
        return self.stepwise_segments(f"{start}>", letters, cups)

    _PROMPT = re.compile(r"^([0-4])>([a-d]+)=$")

    def solve(self, prompt: str) -> str:
        match = self._PROMPT.match(prompt)
        if match is None:
            raise ValueError(f"shells: expected 'CUP>SWAPS=' (cup 0-4, swaps a-d), got {prompt!r}")
        cup = int(match.group(1))
        for letter in match.group(2):
            left, right = self.SWAPS[letter]
            if cup in (left, right):
                cup = left + right - cup
        return str(cup)

    def alphabet(self) -> str:
        return "01234abcd>="

    def chance(self) -> float:
        return 0.2  # one cup of five


TASKS: dict[str, type[ReasoningTask]] = {
    "chains": VariableChains, "addition": Addition, "modsum": RunningSum, "shells": ShellGame,
}


def get_task(name: str, **options: Any) -> ReasoningTask:
    if name not in TASKS:
        raise ValueError(f"unknown reasoning task {name!r}; choose one of {sorted(TASKS)}")
    return TASKS[name](**options)


def make_problems(
    task: ReasoningTask, count: int, difficulties: list[int] | range, seed: int = 0
) -> list[Problem]:
    """`count` problems per difficulty, deterministic in `seed` (each difficulty has its own stream)."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"count={count!r} is invalid: expected an integer >= 1")
    problems = []
    for difficulty in difficulties:
        rng = random.Random(f"{task.name}:{seed}:{difficulty}")
        problems.extend(task.sample(rng, difficulty) for _ in range(count))
    return problems
