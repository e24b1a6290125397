"""Other members of the looped-model family, brought into this library's runtime (docs/looped-family.md).

`families.retrofit`: turn a pretrained transformers causal LM (Llama, Mistral, Phi-3, Qwen2, Qwen3, OLMo-2,
Gemma 1 / 2 / 3 text) into a recurrent-depth model (retrofitted recurrence, arXiv 2511.07384).

`families.ouro`: the dialect of Ouro checkpoints (ByteDance's LoopLM, arXiv 2510.25741), its `config.json`
keys and tensor names, translated to ours on load; a leaf that imports nothing of the package but `files`
(config.py and checkpoint.py import it).

`families.parcae`: the dialect of Parcae checkpoints (arXiv 2604.12946), its `config.json` and tensor names,
translated on load the same way; a leaf that imports nothing of the package.
"""
