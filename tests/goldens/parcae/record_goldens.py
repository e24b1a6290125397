"""Record the Parcae goldens with Parcae's own code (run in a scratch environment, not by pytest).

    python3 -m venv /work/scratch/parcae-env && . /work/scratch/parcae-env/bin/activate
    pip install torch==2.13.0 safetensors numpy
    git -C <parcae checkout> archive dee8363b7c0e1229395edf52a7d751d4a9b9a092 parcae_lm \
        | tar -x -C /work/scratch/parcae-src
    PYTHONPATH=/work/scratch/parcae-src python tests/goldens/parcae/record_goldens.py

For each tiny config below it builds a random `Parcae` model with parcae_lm, perturbs every parameter (so
no term vanishes: the "scaled-zero" init starts output projections at zero), saves the directory with
`parcae_lm.save_pretrained` (its config.json as written), rewrites the pickled `model.pt` as
`model.safetensors` (this library reads no pickles), and stores in `goldens.safetensors`: the input ids,
a fixed s_0, Parcae's fp32 logits from that s_0 after `steps` recurrences, and Parcae's own s_0 draw
(`initialize_state`) after `torch.manual_seed(SEED_STATE)`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import parcae_lm
import torch
from parcae_lm.models.parcae.config import ParcaeConfig
from safetensors.torch import save_file

HERE = Path(__file__).parent
SEED_STATE = 1234
COMMON = dict(block_size=32, vocab_size=64, padding_multiple=64, n_embd=32, num_attention_heads=4,
              intermediate_size=48, block_class_name="TransformerPreNormBlock", norm_class_name="RMSNorm",
              norm_eps=1e-5, init_orthogonal=True, state_init="like-init", recurrent_embedding_dimension=32,
              recurrent_intermediation_embedding_dimension=48, recurrent_iteration_method="per-sequence",
              sampling_scheme="poisson-truncated-full", attn_impl="sdpa")
CONFIGS = {
    # The released models' layout (parcae-small-140m: diagonal injection, ReLU2 MLP, QK-norm, prelude norm,
    # tied embeddings) at toy size; value embeddings in layers 1, 3, 5.
    "released-layout": dict(
        COMMON, name="tiny-released-layout", n_layers_in_prelude=2, n_layers_in_recurrent_block=2,
        n_layers_in_coda=2, mean_recurrence=3, mean_backprop_depth=2, injection_type="diagonal",
        mlp_class_name="BaseMLP", nonlin_name="ReLU2", qk_norm=True, prelude_norm=True, tie_embeddings=True,
        init_strategy="scaled-zero", bias=False, qk_bias=False, steps=3),
    # Parcae's other options: the concat ("linear") injection, a gated SiLU MLP, biases, q/k bias, an untied
    # head, takase's sqrt(h) embedding scale, and value-embedding tables and gates that never meet (only
    # layer 3, the coda's, uses its embedding).
    "linear-gated": dict(
        COMMON, name="tiny-linear-gated", n_layers_in_prelude=2, n_layers_in_recurrent_block=1,
        n_layers_in_coda=1, mean_recurrence=2, mean_backprop_depth=1, injection_type="linear",
        mlp_class_name="GatedMLP", nonlin_name="SiLU", qk_norm=False, prelude_norm=False, tie_embeddings=False,
        init_strategy="takase", bias=True, qk_bias=True, steps=4),
}


def record(name: str, spec: dict) -> None:
    spec = dict(spec)
    steps = spec.pop("steps")
    torch.manual_seed(0)
    config = ParcaeConfig(**spec)
    model = config.construct_model().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.2 * torch.randn(param.shape, generator=gen))
    out = HERE / name
    parcae_lm.save_pretrained(model, str(out))
    state = torch.load(out / "model.pt", weights_only=True)
    save_file({k: v.detach().clone().contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    (out / "model.pt").unlink()

    ids = torch.randint(0, config.padded_vocab_size, (2, 7), generator=gen)
    with torch.no_grad():
        e = model.transformer.wte(ids)
        state0 = 0.5 * torch.randn(2, 7, config.recurrent_embedding_dimension, generator=gen)
        torch.manual_seed(SEED_STATE)
        drawn = model.initialize_state(e)
        model.initialize_state = lambda embeds: state0.clone()  # the fixed s_0
        logits = model(ids, return_logits=True, num_steps_pair=torch.tensor([0, steps]))["logits"]
    save_file({"input_ids": ids, "state": state0, "logits": logits.float().contiguous(),
               "like_init_state": drawn.contiguous()}, str(out / "goldens.safetensors"))
    meta = {"steps": steps, "seed_state": SEED_STATE, "parameters": sum(p.numel() for p in model.parameters()),
            "parcae_commit": "dee8363b7c0e1229395edf52a7d751d4a9b9a092", "torch": torch.__version__}
    (out / "goldens.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(name, meta, file=sys.stderr)


if __name__ == "__main__":
    for name, spec in CONFIGS.items():
        record(name, spec)
