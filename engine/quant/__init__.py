"""Quantized linear weights: a GGUF's own blocks (gguf_tensor.py as loaded, gguf_blocks.py as the kernels read
them), Ember's format for HF weights quantized at load (format.py, quantize.py), and the module the model holds
(module.py). gguf_repack.py (GGUF blocks widened into Ember's format) is the baseline scripts/bench_linear.py
measures against."""
