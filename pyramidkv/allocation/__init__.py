"""Budget allocation, the second axis of a method (after scoring): how a prompt's budget is split
across layers (uniform | pyramid | zigzag) and across the heads of a layer (uniform | adakv | headkv).
"""
