#!/usr/bin/env python
"""Perplexity of dense vs dilated SmolLM2 (or any causal LM) on Shakespeare at several context lengths.

Same as ``hf-dilated eval``; see ``hf-dilated eval --help``. The long-context run (on one H100):

    python scripts/eval_long_context.py --contexts 2048 8192 16384 32768 65536 --device cuda --dtype bfloat16 \
        --windows 2 --output-dir benchmarks/results --name smollm2_long_context
"""

import sys

from hf_dilated.cli import main

if __name__ == "__main__":
    sys.exit(main(["eval", *sys.argv[1:]]))
