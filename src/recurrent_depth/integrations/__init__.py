"""Bridges to the tools people already use: Hugging Face transformers and lm-evaluation-harness.

`import recurrent_depth` calls :func:`install_import_hooks`, which costs microseconds: it imports
neither transformers nor lm-eval. It registers our classes the moment those libraries load the
modules that need them:

- when transformers loads `transformers.models.auto.configuration_auto`, our configs are
  registered with `AutoConfig` (model types ``recurrent_depth`` and the official ``huginn_raven``);
- when it loads `transformers.models.auto.modeling_auto`, our models are registered with
  `AutoModelForCausalLM` and `AutoModelForSequenceClassification`;
- when lm-eval loads `lm_eval.models` (its model table), the ``recurrent-depth`` backend is
  registered as a lazy placeholder (nothing heavy is imported until it is used).
- when peft loads `peft.utils.constants` (its default-target tables), our model types get the LoRA
  trainer's default targets there (`hf_peft.py`), so `LoraConfig(task_type="CAUSAL_LM")` needs no
  `target_modules`.

If a library had already loaded those modules before `recurrent_depth` was imported, the
registration runs at once. :func:`register_transformers` does the transformers part eagerly.
Importing this package installs the hooks (`recurrent_depth/__init__.py` imports it).
"""

from __future__ import annotations

from recurrent_depth.integrations.autoregister import install_import_hooks, register_transformers

__all__ = ["install_import_hooks", "register_transformers"]

install_import_hooks()
