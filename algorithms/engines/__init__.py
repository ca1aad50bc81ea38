"""Compute engines behind the workers: generation (``generation/``: hf, vllm) and training
(``training/``: torch, Megatron-core)."""
