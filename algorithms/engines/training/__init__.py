"""Training engines: what a policy worker computes with. ``mcore_convert`` and ``packing`` are
pure torch (importable and tested on CPU); ``megatron`` imports megatron-core lazily."""
