"""Benchmarks behind `mhsa bench`: ratios against a peer measured in the same run."""
