"""Glue to other libraries (Transformers)."""
