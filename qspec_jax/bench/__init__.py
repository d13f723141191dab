"""Benchmarks (`qspec-bench`): `kernel` (attention kernels on one layer) and `e2e`."""
