"""The ``ray`` backend: tensors in Ray's object store, keys and tags in one metadata actor.

* :mod:`.client`: :class:`~.client.RayStoreClient`, what the trainer and workers call;
* :mod:`.actors`: the metadata actor (``StoreIndex``) and the per-node ``Keeper``;
* :mod:`.table`: one partition of the index as numpy columns.

Nothing is imported here: ``actors`` and ``table`` start in fresh Ray workers and must load
neither torch nor the client (seconds of start-up each).
"""
