"""Compute engines behind the workers (training: torch / Megatron-core)."""
