"""Small, self-contained training experiments that test claims from the research notes (`rdepth experiment`).

* `logit_growth`: the max attention logit under Muon vs AdamW, with and without QK-norm / QK-clip.
"""
