"""Choosing the next token: logits processors, per-row random generators, stop conditions.

Every row of a batch owns a `torch.Generator` seeded from `seed` (an int gives row b the seed
`seed + b`; a list gives one seed per row). A row draws its random initial states and its samples
from its own generator only, in the same order as it would alone, so a batched run reproduces
each row's solo run drawn with that row's seed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor


class RowGenerators:
    """One `torch.Generator` per row; `seeds[b]` reproduces row b alone with `seed=seeds[b]`."""

    def __init__(self, seed: int | Sequence[int] | None, batch_size: int, device: torch.device,
                 global_rng: bool = False) -> None:
        self.global_rng = global_rng and seed is None
        if self.global_rng:
            # The official code's stream: every draw straight from torch's global RNG and none made here, so
            # torch.manual_seed repeats an official run (its s_0 draws); rows then share that one stream.
            self.seeds: list[int] = []
            self.generators: list[torch.Generator | None] = [None] * batch_size
            return
        if seed is None:
            # Unseeded: derive from the global RNG, so torch.manual_seed still controls the run.
            seeds = [int(s) for s in torch.randint(0, 2**62, (batch_size,)).tolist()]
        elif isinstance(seed, int) and not isinstance(seed, bool):
            seeds = [seed + b for b in range(batch_size)]
        elif isinstance(seed, Sequence) and not isinstance(seed, str) and len(seed) == batch_size and all(
            isinstance(s, int) and not isinstance(s, bool) for s in seed
        ):
            seeds = list(seed)
        else:
            raise ValueError(
                f"seed={seed!r} is invalid: expected None, an int (row b uses seed + b) or a list of "
                f"{batch_size} ints (one per row)"
            )
        self.seeds = seeds
        self.generators = []
        for s in seeds:
            g = torch.Generator(device=device)
            g.manual_seed(s % (2**63))
            self.generators.append(g)

    def __getitem__(self, row: int) -> torch.Generator | None:
        return self.generators[row]

    def derived(self, stream: int) -> list[torch.Generator]:
        """One CPU generator per row for another use of the same seeds (`stream` names the use): row b's
        is seeded from seeds[b] and `stream`, so its draws leave the row's own generator untouched."""
        return [stream_generator(s, stream) for s in self.seeds]


def stream_generator(seed: int, stream: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for stream `stream` of `seed` (a row, a window, a use): distinct streams of one seed draw
    independently, and a stream's draws do not depend on how many other streams were drawn before it."""
    return torch.Generator(device=device).manual_seed((seed * 6364136223846793005 + stream) % 2**63)


def apply_repetition_penalty(logits: Tensor, seen: Tensor, penalty: float) -> Tensor:
    """CTRL-style penalty on tokens already in the row (prompt + generated): positive logits are
    divided by `penalty`, negative ones multiplied. logits `[B, V]`, seen bool `[B, V]`."""
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def filter_logits(
    logits: Tensor, temperature: float, top_k: int | None, top_p: float | None, min_p: float | None
) -> Tensor:
    """Temperature, then top-k, top-p (nucleus) and min-p filtering; removed entries become -inf."""
    # Shift each row to a maximum of 0 first (softmax and the filters do not change), and keep the maxima
    # at 0: a tiny temperature then sends the other logits to -inf instead of everything to +-inf or, with
    # a temperature that rounds to 0 in float32, the maxima to 0/0; either way the softmax would be NaN.
    peak = logits.amax(dim=-1, keepdim=True)
    shifted = logits - torch.where(peak.isfinite(), peak, 0)
    logits = torch.where(shifted == 0, shifted, shifted / temperature)
    neg_inf = torch.tensor(float("-inf"), device=logits.device, dtype=logits.dtype)
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = torch.where(logits < kth, neg_inf, logits)
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least the top token).
        before = probs.cumsum(-1) - probs
        drop_sorted = before >= top_p
        drop_sorted[..., 0] = False  # a top_p below float32's smallest number compares 0 >= 0
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = torch.where(drop, neg_inf, logits)
    if min_p is not None and min_p > 0:
        probs = logits.softmax(-1)
        floor = probs.max(dim=-1, keepdim=True).values * min_p
        logits = torch.where(probs < floor, neg_inf, logits)
    return logits


def sample_rows(logits: Tensor, generators: RowGenerators, rows: Sequence[int]) -> Tensor:
    """Sample one token per row from softmax(logits) `[B, V]`, each row with its own generator.

    Uses the exponential race (argmax of p / Exp(1) noise), which draws exactly V numbers per row,
    so a row's stream of draws does not depend on the other rows.
    """
    probs = logits.float().softmax(-1)
    noise = torch.ones_like(probs)
    for b in rows:
        noise[b].exponential_(generator=generators[b])
    return (probs / noise).argmax(-1)


OFFICIAL_TOP_K = 50  # transformers 4.56's GenerationConfig.top_k, which the official loops read when unset


def official_draw(logits: Tensor, temperature: float, top_k: int | None, top_p: float | None,
                  min_p: float | None) -> Tensor:
    """The official loops' sampled token `[B]` (`_sample_next_token` of raven_modeling_minimal.py at 59e0b69),
    drawn from torch's global RNG with one `torch.multinomial` over the whole batch, so that
    `torch.manual_seed` repeats an official run. The official rules differ from `filter_logits`: the filters
    act on probabilities in the order top-k (default 50), top-p, min-p, and top-p drops every token whose
    cumulative probability (sorted, the top-k's zeros not renormalised) exceeds top_p (default 1.0), so the
    token crossing top_p is dropped too (the top one always stays)."""
    probs = (logits.float() / (temperature or 1.0)).softmax(-1)
    top_k = OFFICIAL_TOP_K if top_k is None else top_k
    if top_k:
        kth = torch.topk(probs, min(top_k, probs.shape[-1]), dim=-1).values[..., -1:]
        probs = torch.where(probs < kth, 0.0, probs)
    top_p = 1.0 if top_p is None else top_p
    if top_p:
        ordered, order = torch.sort(probs, dim=-1, descending=True)
        drop = ordered.cumsum(-1) > top_p
        drop[..., 0] = False
        probs = torch.where(torch.zeros_like(drop).scatter(-1, order, drop), 0.0, probs)
    if min_p:
        probs = torch.where(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0, probs)
    probs = probs / probs.sum(-1, keepdim=True).clamp(min=1e-10)
    return torch.multinomial(probs, 1)[:, 0]


class TokenChooser:
    """Greedy or sampled choice with the processors in a fixed order: repetition penalty,
    temperature, top-k, top-p, min-p. Keeps the per-row "seen tokens" table for the penalty."""

    def __init__(self, options: Any, vocab_size: int, generators: RowGenerators) -> None:
        self.options = options
        self.vocab_size = vocab_size
        self.generators = generators
        self.seen: Tensor | None = None

    def observe_prompt(self, input_ids: Tensor, valid: Tensor) -> None:
        if self.options.repetition_penalty == 1.0:
            return
        B = input_ids.shape[0]
        self.seen = torch.zeros(B, self.vocab_size, dtype=torch.bool, device=input_ids.device)
        valid = valid.bool()
        rows = torch.arange(B, device=input_ids.device)[:, None].expand_as(input_ids)
        self.seen[rows[valid], input_ids[valid]] = True  # padding does not count as seen

    def observe(self, tokens: Tensor, rows: Tensor | None = None) -> None:
        """Record generated tokens `[B]` (only for `rows` bool [B] when given)."""
        if self.seen is None:
            return
        mark = torch.ones_like(tokens, dtype=torch.bool) if rows is None else rows
        self.seen[torch.arange(tokens.shape[0], device=tokens.device)[mark], tokens[mark]] = True

    def process(self, logits: Tensor) -> Tensor:
        """Processed logits `[B, V]` (greedy uses them too, so the penalty applies to greedy)."""
        opts = self.options
        if self.seen is not None:
            logits = apply_repetition_penalty(logits, self.seen, opts.repetition_penalty)
        if opts.do_sample:
            logits = filter_logits(logits, opts.temperature, opts.top_k, opts.top_p, opts.min_p)
        return logits

    def choose(self, logits: Tensor, rows: Sequence[int]) -> Tensor:
        """Next token `[B]` from logits `[B, V]`; `rows` are the unfinished rows that draw randomness."""
        if self.options.do_sample and self.generators.global_rng:  # official defaults, no seed: its draw
            opts = self.options
            if self.seen is not None:
                logits = apply_repetition_penalty(logits, self.seen, opts.repetition_penalty)
            done = torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)
            done[list(rows)] = False  # a finished row still draws (as there), from flat logits whatever its own
            logits = torch.where(done[:, None], 0.0, logits)
            return official_draw(logits, opts.temperature, opts.top_k, opts.top_p, opts.min_p)
        processed = self.process(logits)
        if not self.options.do_sample:
            return processed.argmax(-1)
        return sample_rows(processed, self.generators, rows)


class StopChecker:
    """Stop token ids (including the eos ids) and stop strings (need a tokenizer).

    A stop string is searched in the row's generated text decoded with special tokens kept: "<|im_end|>" matches
    that special token, as transformers' `stop_strings` (its StopStringCriteria covers the whole vocabulary,
    special tokens included), which `integrations.hf` routes here. The server matches its returned text instead
    (vLLM's rule: special tokens skipped unless skip_special_tokens is false; `serving.text.TextState`)."""

    def __init__(self, stop: Any, eos_ids: Sequence[int] = (), vocab_size: int = 0, tokenizer: Any = None) -> None:
        ids: set[int] = set()
        strings: list[str] = []
        items = [] if stop is None else ([stop] if isinstance(stop, int | str) else list(stop))
        for item in items:
            if isinstance(item, bool) or not isinstance(item, int | str):
                raise ValueError(f"stop={stop!r} is invalid: expected token ids (int) and/or strings")
            if isinstance(item, int):
                if not 0 <= item < vocab_size:
                    raise ValueError(f"stop token id {item} is outside the vocabulary [0, {vocab_size})")
                ids.add(item)
            elif item == "":
                raise ValueError("stop strings must be non-empty")
            else:
                strings.append(item)
        if strings and tokenizer is None:
            raise ValueError(f"stop strings {strings!r} need a tokenizer: pass tokenizer=... to generate")
        ids.update(eos_ids)
        self.ids = ids
        self.strings = strings
        self.tokenizer = tokenizer

    def hits_string(self, generated: list[int]) -> bool:
        """True when the decoded generated text of one row contains a stop string."""
        if not self.strings:
            return False
        text = decode(self.tokenizer, generated)
        return any(s in text for s in self.strings)


def decode(tokenizer: Any, ids: list[int]) -> str:
    """Decode with a `tokenizers.Tokenizer` or a transformers tokenizer."""
    try:
        return tokenizer.decode(ids, skip_special_tokens=False)
    except TypeError:
        return tokenizer.decode(ids)
