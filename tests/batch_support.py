"""Running several requests as rows of one serving batch (tests compare each with generate alone)."""

from __future__ import annotations

from recurrent_depth.inference.options import GenerationOptions
from recurrent_depth.serving.batch import BatchDecoder, RowRequest


def serve_in_one_batch(model, jobs: list[tuple[list[int], dict]]) -> dict[int, list]:
    """Every job (prompt, generate options) as a row of one serving batch: job index -> its token results."""
    dec = BatchDecoder(model, max_rows=len(jobs))
    out: dict[int, list] = {}
    for j, (prompt, kw) in enumerate(jobs):
        opts = GenerationOptions(**kw).validate(model.config.mean_recurrence)
        _, first, _ = dec.add(RowRequest(prompt, opts, 0), tag=j)
        out[j] = [first]
    while len(dec):
        for seq, result in dec.step():
            out[seq.tag].append(result)
            if len(out[seq.tag]) >= jobs[seq.tag][1]["max_new_tokens"]:
                dec.remove(seq)
    return out
