"""Our model types in peft's default-target tables, so `LoraConfig(task_type="CAUSAL_LM")` needs no `target_modules`.

peft fills a config's missing `target_modules` from a table keyed by `config.model_type` and refuses a type it
does not know ("Please specify `target_modules` in `peft_config`"). The import hooks (`autoregister.py`) call
`register_peft` right after peft's `peft.utils.constants` executes (or at once, if peft was imported first), so
peft is never imported on our account. The targets are the trainers' default (`train/lora.py`: every linear layer
of each block's mixer and MLP, and the input adapter), in every table whose llama entry is LoRA's (LoRA's copies:
LoHa, LoKr, AdaLoRA, OFT, ...); IA3 gets its own, as peft gives llama its own.
"""

from __future__ import annotations

from types import ModuleType

from recurrent_depth.config import HUGINN_MODEL_TYPE, MODEL_TYPE
from recurrent_depth.families.ouro import OURO_MODEL_TYPE

# Every model type the Auto classes know ours by (`hf_config.register_configs`).
MODEL_TYPES = (MODEL_TYPE, HUGINN_MODEL_TYPE, OURO_MODEL_TYPE)
LORA_TABLE = "TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING"
TABLE_SUFFIX = "_TARGET_MODULES_MAPPING"
# IA3 rescales activations: as peft's llama entry (k_proj, v_proj, down_proj; down_proj feed-forward), the layers
# that make keys and values (fused in Wqkv; MLA's wkv_b) and the MLP's output projection.
IA3_TABLE = "TRANSFORMERS_MODELS_TO_IA3_TARGET_MODULES_MAPPING"
IA3_FEEDFORWARD_TABLE = "TRANSFORMERS_MODELS_TO_IA3_FEEDFORWARD_MODULES_MAPPING"
IA3_TARGETS = ("attn.Wqkv", "attn.k_proj", "attn.v_proj", "attn.wkv_b", "mlp.proj")
IA3_FEEDFORWARD = ("mlp.proj",)


def register_peft(constants: ModuleType | None = None) -> None:
    """Add our model types to peft's default-target tables (`constants`: the module `peft.utils.constants`,
    imported when not given). An entry peft (or the user) already has for a type is kept. Idempotent."""
    if constants is None:
        import peft.utils.constants as constants
    from recurrent_depth.train.lora import default_target_suffixes

    lora = getattr(constants, LORA_TABLE)
    reference = lora.get("llama")  # what tells LoRA's copies from tables of another kind (layer norms, IA3, ...)
    targets = default_target_suffixes()
    for name in dir(constants):
        table = getattr(constants, name)
        if table is lora or (name.endswith(TABLE_SUFFIX) and isinstance(table, dict)
                             and reference is not None and table.get("llama") == reference):
            for model_type in MODEL_TYPES:
                table.setdefault(model_type, list(targets))
    for name, entry in ((IA3_TABLE, IA3_TARGETS), (IA3_FEEDFORWARD_TABLE, IA3_FEEDFORWARD)):
        table = getattr(constants, name, None)
        if isinstance(table, dict):
            for model_type in MODEL_TYPES:
                table.setdefault(model_type, list(entry))
