#!/usr/bin/env python3
"""Long generations under a KV-cache compression method (GSM8K, MATH-500, a generated chain; see docs/reasoning.md).

Example (fullkv first: the methods are compared with its traces):
    python run_reasoning.py --method fullkv --tasks chain gsm8k --num_samples 4
    python run_reasoning.py --method h2o --max_capacity_prompts_ratio 1 --decode_budget 128 --tasks chain gsm8k --num_samples 4
"""

import sys

from pyramidkv.benchmarks.reasoning.run import main

if __name__ == "__main__":
    sys.exit(main())
