"""Benchmarks of `reliable-kafka bench`: each variant as a ratio against a baseline in the same run."""
