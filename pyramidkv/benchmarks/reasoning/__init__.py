"""Long generations (docs/reasoning.md): GSM8K, MATH-500 and a generated arithmetic chain, each trace compared
with fullkv's (KL along fullkv's trace, the departure step) and measured (length, K/V bytes, decode speed)."""
