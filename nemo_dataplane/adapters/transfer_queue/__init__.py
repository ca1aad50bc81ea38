"""The ``transfer_queue`` backend: :class:`DataPlaneClient` over TransferQueue 0.1.11 on Ray.

* :mod:`.client`: :class:`~.client.TransferQueueClient`, the data ops (put/get/clear/list);
* :mod:`.store`: bootstrap, lifecycle and the bounded op plumbing (timeouts, liveness watch);
* :mod:`.claims`: task-mediated claims on TransferQueue's own bookkeeping;
* :mod:`.compat`: every TransferQueue workaround, numbered; nothing else touches TransferQueue.

Nothing is imported here: ``compat`` modules also load inside TransferQueue's actors (the claim
sampler in the controller, the row mapper in the storage units), which need no client.
"""
