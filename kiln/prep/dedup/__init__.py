"""Deduplication for `kiln prep`: exact hashes, Bloom filter, MinHash-LSH, SimHash, suffix array.

Each method is plain library code usable on its own (`exact`, `bloom`, `minhash`, `simhash`,
`suffix_array`); `steps` wraps them as pipeline steps. See docs/dedup.md for when to use which.
"""

# Importing the package registers the dedup step types with the pipeline.
from kiln.prep.dedup import steps as _steps  # noqa: E402,F401
