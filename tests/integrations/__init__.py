"""Clients of the public API: Hugging Face transformers models over kvcupy's caches."""
