"""The weight and KV cache formats an engine can be asked for: the one list the config offers
and the loader takes (no torch here: the config is read where torch is not)."""

# Linear weights: full width, int8 quantized at load (int8_linear.py), a GGUF's blocks as
# stored (gguf_linear.py), fp8 on CUDA (fp8_linear.py).
QUANTIZATIONS = ("none", "int8", "gguf", "fp8")
# The KV cache: the model's dtype, or fp8 e4m3.
KV_CACHE_DTYPES = ("auto", "fp8")
