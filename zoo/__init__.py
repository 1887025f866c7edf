"""The zoo sweep: every transformers architecture built tiny, given a sample input, run and verified."""
