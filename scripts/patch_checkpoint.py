#!/usr/bin/env python
"""Patch a checkpoint (directory, .gguf file or 'smollm2') to dilated attention; same as ``hf-dilated patch``.

    python scripts/patch_checkpoint.py smollm2 out/smollm2-dilated --context-length 65536
"""

import sys

from hf_dilated.cli import main

if __name__ == "__main__":
    sys.exit(main(["patch", *sys.argv[1:]]))
