"""Torch-free bookkeeping: scheduler, page pool, prefix cache, sequences, swap space, adapter residency."""
