"""kvcupy inside other libraries, built on kvcupy's public API alone.

- `kvcupy.integrations.transformers`: Hugging Face transformers models generate
  over a quantized paged cache (`transformers` extra).

Each module imports without its library installed and says what is missing
when it is used.
"""
