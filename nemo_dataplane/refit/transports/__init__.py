"""How refit bytes move: collectives over NCCL/gloo (``collective``), CUDA IPC peer copies
(``cuda_ipc``), and the shard-to-shard exchange of a reshard (``exchange``)."""
