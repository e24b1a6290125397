"""Dataset builders for the shipped lm-eval tasks (`custom_dataset: !function utils.<name>`).

lm-eval calls them with the task's `metadata` and `dataset_kwargs` as keyword arguments, so every
builder accepts and ignores extra keys (such as `version`).
"""

from __future__ import annotations

from typing import Any

from datasets import Dataset, DatasetDict

from recurrent_depth.evaluation.reasoning.tasks import get_task, make_problems

DIGITS = [str(d) for d in range(10)]


def _difficulties(value: Any, name: str) -> list[int]:
    values = [value] if isinstance(value, int) else list(value)
    if not values:
        raise ValueError(f"{name} is empty: expected a list of integers")
    return [int(v) for v in values]


def _split(task_name: str, difficulties: list[int], count: int, seed: int, options: dict[str, Any]) -> Dataset:
    task = get_task(task_name, **options)
    rows = [
        {"prompt": p.prompt, "answer": p.answer, "difficulty": p.difficulty, "choices": DIGITS,
         "label": DIGITS.index(p.answer) if p.answer in DIGITS else -1}
        for p in make_problems(task, int(count), difficulties, seed=seed)
    ]
    return Dataset.from_list(rows)


def chains_dataset(
    hops: Any = (1, 2, 3, 4), count: int = 50, num_chains: int = 4, seed: int = 1234, fewshot_count: int = 16,
    **_: Any,
) -> DatasetDict:
    """`count` chain problems per hop count (test) and a few-shot pool drawn with another seed (train)."""
    difficulties = _difficulties(hops, "hops")
    options = {"num_chains": int(num_chains)}
    return DatasetDict(
        test=_split("chains", difficulties, count, seed, options),
        train=_split("chains", difficulties, fewshot_count, seed + 1, options),
    )


def addition_dataset(
    digits: Any = (1, 2, 3), count: int = 50, seed: int = 1234, fewshot_count: int = 16, **_: Any
) -> DatasetDict:
    difficulties = _difficulties(digits, "digits")
    return DatasetDict(
        test=_split("addition", difficulties, count, seed, {}),
        train=_split("addition", difficulties, fewshot_count, seed + 1, {}),
    )


def stdlib_dataset(max_docs: int = 16, max_chars: int = 4000, val_fraction: float = 0.02, seed: int = 0,
                   **_: Any) -> DatasetDict:
    """Held-out standard-library files (the training split's validation side), cut to `max_chars`."""
    from recurrent_depth.data.corpus import DocumentSplit, StdlibCorpus

    corpus = StdlibCorpus()
    split = DocumentSplit.plan(corpus.ids(), val_fraction, seed=seed)
    rows = []
    for doc in split.select(corpus, "validation"):
        rows.append({"text": doc.text[: int(max_chars)], "id": doc.id})
        if len(rows) >= int(max_docs):
            break
    if not rows:
        raise ValueError(f"no held-out standard-library files at val_fraction={val_fraction}")
    return DatasetDict(test=Dataset.from_list(rows))
