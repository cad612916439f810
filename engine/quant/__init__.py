"""Quantized linear weights: Ember's one in-memory format (format.py), GGUF block types repacked into it
(gguf_repack.py), HF weights quantized into it at load (quantize.py), and the module the model holds (module.py)."""
