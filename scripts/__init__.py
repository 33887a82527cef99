"""The programs built on the library (fine-tuning, long-context evaluation, benchmarks, demo). They run as files
(``python scripts/finetune.py``) and ship inside the package as ``hf_dilated.scripts`` for the ``hf-dilated`` command."""
