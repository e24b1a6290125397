"""Running several requests as rows of one serving batch (tests compare each with generate alone)."""

from __future__ import annotations

from recurrent_depth.inference.options import GenerationOptions
from recurrent_depth.serving.batch import BatchDecoder, RowRequest


def serve_in_one_batch(model, jobs: list[tuple[list[int], dict]], kv_quant: str | None = None,
                       seed_by_job: bool = False, top_logprobs: int | None = None) -> dict[int, list]:
    """Every job (prompt, generate options) as a row of one serving batch: job index -> its token results
    (row j seeded 0, or j with `seed_by_job`; the pool storing `kv_quant`)."""
    dec = BatchDecoder(model, max_rows=len(jobs), kv_quant=kv_quant)
    out: dict[int, list] = {}
    for j, (prompt, kw) in enumerate(jobs):
        opts = GenerationOptions(**kw).validate(model.config.mean_recurrence)
        request = RowRequest(prompt, opts, j if seed_by_job else 0, top_logprobs=top_logprobs)
        _, first, _ = dec.add(request, tag=j)
        out[j] = [first]
    while len(dec):
        for seq, result in dec.step():
            out[seq.tag].append(result)
            if len(out[seq.tag]) >= jobs[seq.tag][1]["max_new_tokens"]:
                dec.remove(seq)
    return out
