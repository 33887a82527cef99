#!/usr/bin/env python
"""Fine-tune with dilated (or dense) attention at long context: see ``hf_dilated/finetune.py`` or ``--help``."""

import sys

from hf_dilated.finetune import main

if __name__ == "__main__":
    sys.exit(main())
