"""CUDA pieces both families' IPC transports use: IPC handles, peer mappings and push targets
(``ipc.py``), copy-engine copies through the CUDA runtime bindings (``copy_engine.py``)."""
