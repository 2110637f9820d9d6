#!/usr/bin/env python
"""Needle in a haystack with a KV-cache compression method (see docs/needle.md).

Example (CPU, the embedded SmolLM2-135M-Instruct):
    python run_needle_in_haystack.py --method snapkv --max_capacity_prompts 128 \
        --s_len 1000 --e_len 4000 --step 1000 --num_depths 5
"""

import sys

from pyramidkv.benchmarks.needle.run import main

if __name__ == "__main__":
    sys.exit(main())
