"""Every workaround for a TransferQueue 0.1.11 quirk, in one package.

The adapter (:mod:`nemo_dataplane.adapters.transfer_queue.client` and its store and claims
halves) talks to TransferQueue only through this package (import it as a whole:
``from nemo_dataplane.adapters.transfer_queue import compat``; every name below is re-exported
here). Nothing the adapter calls patches the dependency in the caller's process: each function
calls a TransferQueue API (public or, where the public one misbehaves, the internal one it wraps)
in a way that sidesteps one of the behaviours below, each seen on a 2-CPU machine; the changes
inside TransferQueue's own actors are quirks 12, 13, 14's lock and 15, and the one patch of a
caller's process is :func:`admit_transfer_queue_clients`, which only a process that uses
TransferQueue's own API calls (quirk 15). By responsibility:

* :mod:`.bootstrap`: starting and finding a store (controller, storage units, placement, clients,
  where they listen);
* :mod:`.wire`: who may talk to them (CURVE keys, the ZAP handler, handshake counts);
* :mod:`.writes`: rows into the units, tags and production notices to the controller;
* :mod:`.reads`: rows back out (mapped from the writers' objects, stacked by units, or per row);
* :mod:`.mapped`: which writer's object a stored row is a view of (runs inside the units);
* :mod:`.claims`: the controller-side sampler and the claim requests;
* :mod:`.hosted`: each op in one request when the controller holds the only unit;
* :mod:`.common`: the reserved layout tag, log and torch-thread hygiene.

The quirks:

1. ``tq.init()`` asks Ray for 3 CPUs (controller + 2 storage units, ``num_cpus=1`` each) and then
   blocks forever on a 2-CPU cluster -> :func:`create_controller` / :func:`create_storage_units`
   size the actors with fractional CPUs and every wait has a timeout.
2. ``interface.py`` keeps the client, controller and storage in module globals that go stale
   after ``ray.shutdown()``, and its ``close()`` kills the shared controller from any process ->
   the adapter owns its own client (:func:`make_client`) and actor handles.
3. ``TransferQueueClient.async_put``/``async_get_data`` wrap every call in
   ``limit_pytorch_auto_parallel_threads``, which sets ``torch.set_num_threads`` and restores it
   to the value seen at *import* time, warning on every op when ``TQ_NUM_THREADS`` exceeds the
   core count -> :func:`put_rows`/:func:`get_rows` drive the storage manager directly and
   :func:`preserve_torch_threads` restores the caller's setting regardless.
4. A get rebuilds every non-scalar field as a jagged nested tensor with
   ``torch.nested.as_nested_tensor`` (one copy plus per-row work) -> :func:`get_rows` returns
   the decoded per-row views so the adapter assembles each field once, in C, with
   ``torch.stack``/``torch.cat``.
5. A jagged field is sent as one ZMQ frame *per row* and its schema is built with a Python loop
   over ``unbind()`` -> :func:`put_rows` sends it as one flat buffer per storage unit and lets a
   tiny ``data_parser`` (run inside the storage unit, a documented SimpleStorage hook) cut it into
   per-row views there, so the store holds exactly the rows TransferQueue's own clients expect.
6. Missing keys / unknown fields are dropped with only a log warning, and per-op log lines are
   noisy -> the adapter checks itself; :func:`quiet_logs` mutes TransferQueue's loggers, here
   and (through :func:`ask_server_info`) inside the actors we start. Not through a ``runtime_env``:
   that costs each actor a fresh worker process instead of an idle prestarted one.
7. A get reply carries one ZMQ frame per row per field (769 frames for a 256-sample batch of three
   fields), encoded and decoded row by row; that, not the bytes, is where a read's time goes ->
   :func:`read_columns` asks each storage unit (via Ray's documented ``__ray_call__``) to run the
   very ``storage_data.get_data`` call its ZMQ handler runs, stack the rows into one buffer per
   field there, and hand that back through the Ray object store. Read-only: writes keep going
   through TransferQueue's ZMQ protocol, so the unit's own threads never race a foreign writer.
   Stores whose units cannot be found by name (created by ``tq.init()``) use :func:`get_rows`.
8. Claims (task-mediated consumption) use TransferQueue's own bookkeeping: a ``fetch`` GET_META
   scans production/consumption, samples and marks consumed in one controller request, so
   concurrent claimers never share a row. But (a) with ``polling_mode=False`` (TQ's default) a
   fetch that finds too few rows sleeps 5 s *inside the controller's only request thread* and
   then errors, stalling every other client; (b) fetch needs ``batch_size`` ready rows, so it
   cannot take "what is there" at a deadline; (c) the sampler orders by global index, which TQ
   reuses across partitions after clears, not by production; (d) there is no request that marks
   chosen rows consumed. -> :func:`create_controller` starts the controller with
   ``polling_mode=True`` and :class:`ClaimSampler`, which takes up to ``nd_take`` keyed rows in
   key-insertion order once ``nd_min`` are ready, or marks exactly ``nd_mark_keys``
   (:func:`ask_claim`, :func:`mark_rows`). Polling mode returns at once when too few rows are
   there; rather than asking again and again, a claim (:func:`ask_claim`) runs the very fetch
   the GET_META handler runs inside the controller, on a thread of its own, and between tries
   sleeps on a condition the controller subclass notifies whenever rows become produced, so it
   returns as soon as its rows are there. Stores made elsewhere (``tq.init()``) lack all this:
   :func:`claims_unsupported` says why.
9. A fetch returns global indexes, not keys, and ``kv_retrieve_keys`` raises when a partition
   vanished meanwhile -> the claim looks its rows' keys up inside the controller in the same
   locked step that picked them, so none can be cleared in between.
10. TransferQueue's own ``put`` marks rows produced before it writes their tags, so a claimer can
   see a row without its tags -> :func:`put_rows` only writes rows; once they are written, the
   adapter's :func:`set_tags` request to a controller of ours carries the production notice
   too, which the controller subclass records after the tags, under its lock (one request);
   on a store started elsewhere, :func:`mark_produced` follows :func:`set_tags`.
11. A put through TransferQueue's ZMQ protocol serializes every row into frames and the unit
   deserializes them (two copies plus per-row work), and there is no way to hand a unit data that
   is already in Ray's object store -> with the units' handles, :func:`put_rows` ``ray.put``s each
   put once (:func:`put_chunk`) and asks each unit (``__ray_call__``) to map that object and store
   one view per row through the very ``storage_data.put_data`` call its PUT handler makes, so
   TransferQueue's own clients read the rows as usual; :mod:`.mapped` lets our reads find the
   object again from a row's address and map it themselves (:func:`read_columns`). A put up to
   :data:`INLINE_MAX_BYTES` (:func:`rides_inline`) skips the object store: its rows travel
   inside the unit's call, and the unit stacks them for reads.
12. The controller and storage units bind their ZMQ sockets to the node's routable address (Ray's
   ``get_node_ip_address``, which never answers loopback), even when every client is on that
   node, and decode what they receive with ``pickle``: anyone who reaches the port runs code in
   them -> :func:`create_controller` / :func:`create_storage_units` start subclasses whose
   ``__init__`` first points the TransferQueue module's ``get_node_ip_address`` (in that actor's
   own process only) at ``listen_host``, so a single-node store listens on loopback and its
   published endpoints say so.
13. A storage unit's constructor sleeps a fixed 0.5 s between starting its worker thread and its
   proxy thread ("make sure worker thread is ready"), on the path of every store's start-up ->
   :func:`create_storage_units` starts a subclass whose ``__init__`` hands that one function a
   ``time`` whose ``sleep`` returns at once (in that actor's own process, for the constructor
   only): the proxy forwards into a DEALER socket, whose send waits for the worker to connect.
14. Every op is several requests: a put looks its keys up, writes the rows, stores the tags and
   marks the rows produced (four round trips, each decoded and answered by per-key Python on the
   controller's one request thread), a get looks up and reads (two), a clear hides, frees and
   forgets (three); none is atomic against another client's -> when the controller holds the
   store's only unit (``unit_in_controller``), :mod:`.hosted` runs the very controller and unit
   methods those requests run inside the controller's process, one Ray call per op
   (:func:`hosted_put`, :func:`hosted_locate`, :func:`hosted_clear`, called as the controller
   subclass's methods ``nd_put``/``nd_locate``/``nd_clear``, which a sync caller waits on in
   its own thread: :mod:`nemo_dataplane.adapters.steps`); the controller subclass
   takes one lock around each ZMQ request it serves and each of those ops, so they are atomic
   against each other and against TransferQueue's own clients.
15. Quirk 12 keeps a one-node store off the network, but any process of the host, and with
   ``listen: node`` any host that reaches the nodes, still connects to the controller's two
   ports and every unit's, and the first frame it sends is unpickled there: one message runs
   code in the store (it keeps serving, so nothing shows) -> :func:`create_controller` /
   :func:`create_storage_units` take the store's :class:`WireKeys` (:func:`wire_keys`, derived
   from a secret) and their subclasses' ``__init__`` hands ``_init_zmq_socket`` (in that actor's
   own process) a ``create_zmq_socket`` whose ROUTER sockets are ZMQ CURVE servers; a ZAP handler
   (:class:`.wire.Guard`, one thread per actor process) admits only peers proving the client
   key, so no frame of anyone else is delivered, let alone decoded. Our clients carry the keys on
   every socket (:func:`make_client`: the context's default options, and
   :class:`.wire.AuthenticatedStorageManager` for the storage manager's start-up handshake,
   which TransferQueue opens on a private context); so does the controller's own context.
   Clients that attach get the keys from the controller through Ray (:func:`ask_config`).
   TransferQueue's own clients (``tq.init()``) reach such a store only in a process that calls
   :func:`admit_transfer_queue_clients` first (it patches TransferQueue there, so only such a
   process does). Each actor counts handshakes admitted and refused per endpoint
   (:func:`ask_wire_stats`).
"""

from transfer_queue.metadata import BatchMeta
from transfer_queue.storage import StorageKeyNotFoundError

from nemo_dataplane.adapters.transfer_queue.compat.bootstrap import (
    ActorStart,
    ask_config,
    ask_server_info,
    ask_wire_stats,
    base_config,
    create_controller,
    create_storage_units,
    make_client,
    server_info,
    storage_units_of,
    unit_config,
    unit_handles,
    unit_nodes,
)
from nemo_dataplane.adapters.transfer_queue.compat.claims import (
    CLAIM_SAMPLER,
    ClaimSampler,
    ask_claim,
    ask_claim_stats,
    cancel_claim,
    claims_unsupported,
    mark_rows,
)
from nemo_dataplane.adapters.transfer_queue.compat.common import (
    BACKEND,
    LAYOUT_TAG,
    loop_thread,
    preserve_torch_threads,
    public_tags,
    quiet_logs,
)
from nemo_dataplane.adapters.transfer_queue.compat.hosted import (
    Located,
    PutDone,
    merged_tags,
)
from nemo_dataplane.adapters.transfer_queue.compat.hosted import clear as hosted_clear
from nemo_dataplane.adapters.transfer_queue.compat.hosted import locate_rows as hosted_locate
from nemo_dataplane.adapters.transfer_queue.compat.hosted import put as hosted_put
from nemo_dataplane.adapters.transfer_queue.compat.reads import (
    Column,
    column_from_rows,
    get_rows,
    read_columns,
)
from nemo_dataplane.adapters.transfer_queue.compat.wire import (
    WireKeys,
    admit_transfer_queue_clients,
    wire_keys,
)
from nemo_dataplane.adapters.transfer_queue.compat.writes import (
    INLINE_MAX_BYTES,
    PRODUCED,
    chunk_of,
    field_schema,
    mark_produced,
    put_chunk,
    put_rows,
    rides_inline,
    set_tags,
)

__all__ = [
    "BACKEND",
    "CLAIM_SAMPLER",
    "INLINE_MAX_BYTES",
    "LAYOUT_TAG",
    "PRODUCED",
    "Located",
    "PutDone",
    "chunk_of",
    "hosted_clear",
    "hosted_locate",
    "hosted_put",
    "merged_tags",
    "ActorStart",
    "BatchMeta",
    "ClaimSampler",
    "Column",
    "StorageKeyNotFoundError",
    "WireKeys",
    "admit_transfer_queue_clients",
    "ask_config",
    "ask_server_info",
    "ask_wire_stats",
    "base_config",
    "ask_claim",
    "ask_claim_stats",
    "cancel_claim",
    "claims_unsupported",
    "column_from_rows",
    "create_controller",
    "create_storage_units",
    "field_schema",
    "get_rows",
    "loop_thread",
    "make_client",
    "mark_produced",
    "mark_rows",
    "preserve_torch_threads",
    "public_tags",
    "put_chunk",
    "put_rows",
    "quiet_logs",
    "rides_inline",
    "read_columns",
    "server_info",
    "set_tags",
    "storage_units_of",
    "unit_config",
    "unit_handles",
    "unit_nodes",
    "wire_keys",
]
