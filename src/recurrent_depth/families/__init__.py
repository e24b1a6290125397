"""Other members of the looped-model family, brought into this library's runtime (docs/looped-family.md).

`families.retrofit`: turn a pretrained transformers causal LM (Llama, Qwen2, Qwen3, OLMo-2) into a
recurrent-depth model (retrofitted recurrence, arXiv 2511.07384).
"""
