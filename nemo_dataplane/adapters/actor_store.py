"""The lifecycle shared by the backends whose store is named Ray actors (``transfer_queue``, ``ray``).

:class:`ActorBackedClient` owns what does not depend on what the actors are: joining or starting
Ray, the ``bootstrap`` modes (create, attach, or either; losing a creation race to another process
under ``"auto"`` attaches to the winner), ``data_plane.backend_kwargs`` naming the actor, and an
idempotent :meth:`~ActorBackedClient.close` that kills only what this client created and shuts
Ray down only if it started it. A subclass says how to create, attach to and tear down its
actors, and what to release on close.
"""

from __future__ import annotations

import os
import threading
from abc import abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import ray

from nemo_dataplane.client import DataPlaneClient, DataPlaneError
from nemo_dataplane.config import DataPlaneConfig

if TYPE_CHECKING:  # pragma: no cover - typing only
    from typing_extensions import Self

Bootstrap = bool | Literal["auto"]


class ActorBackedClient(DataPlaneClient):
    """Base of a :class:`DataPlaneClient` whose store is a named Ray actor (plus helpers it starts).

    Subclasses set the class attributes below and implement :meth:`_create`, :meth:`_attach`,
    :meth:`_teardown` and :meth:`_disconnect`; their ``__init__`` calls :meth:`_open`.
    """

    BACKEND: ClassVar[str]  # data_plane.backend value, for error messages
    SECTION: ClassVar[str]  # the data_plane config section the client takes
    NAME_KWARG: ClassVar[str]  # the constructor argument naming the actor
    WHAT: ClassVar[str]  # what the named actor is, for error messages

    cfg: Any  # the SECTION config: ray_address, bootstrap_timeout_s, ...
    actor_name: str
    namespace: str
    owns_store: bool  # this client created the named actor: its close ends the store
    started_ray: bool  # this client started Ray: its close shuts it down

    def _open(self, bootstrap: Bootstrap, name: str, namespace: str, log_to_driver: bool) -> Any:
        """Join or start Ray, then create or attach to the named actor per ``bootstrap``; returns
        what :meth:`_create` / :meth:`_attach` returned. On failure, tears down what it created
        and shuts down a Ray it started, then re-raises."""
        if bootstrap not in (True, False, "auto"):
            raise ValueError(f"bootstrap must be True, False or 'auto', got {bootstrap!r}")
        self.actor_name, self.namespace = name, namespace
        self.owns_store = self.started_ray = False
        self._closed = False
        self._close_lock = threading.Lock()
        self._ensure_ray(log_to_driver)
        try:
            return self._bootstrap(bootstrap)
        except BaseException:
            self._teardown()
            if self.started_ray and ray.is_initialized():
                ray.shutdown()
            raise

    @classmethod
    def from_config(cls, cfg: DataPlaneConfig, bootstrap: Bootstrap = "auto") -> Self:
        """Build from the ``data_plane`` config (the factory's hook).

        ``data_plane.backend_kwargs`` may set the actor's name (:attr:`NAME_KWARG`) and ``namespace``.
        """
        kwargs = dict(cfg.backend_kwargs or {})
        known = (cls.NAME_KWARG, "namespace")
        unknown = sorted(set(kwargs) - set(known))
        if unknown:
            raise ValueError(
                f"data_plane.backend_kwargs {unknown} are not understood by the {cls.BACKEND} backend "
                f"(known: {', '.join(known)})"
            )
        # A subclass's __init__(config, bootstrap, <NAME_KWARG>, namespace); this base has none of its own.
        make: Callable[..., Self] = cls
        return make(getattr(cfg, cls.SECTION), bootstrap=bootstrap, **kwargs)

    # ------------------------------------------------------------- bootstrap
    def _ensure_ray(self, log_to_driver: bool) -> None:
        if ray.is_initialized():
            return
        address = self.cfg.ray_address or os.environ.get("RAY_ADDRESS")
        if address:
            ray.init(address=address, log_to_driver=log_to_driver)
        else:
            # No address given: a private local cluster, never one a finished or killed run
            # left behind (ray.init() alone would attach to it).
            ray.init(address="local", include_dashboard=False, log_to_driver=log_to_driver)
            self.started_ray = True

    def _find(self) -> Any | None:
        try:
            return ray.get_actor(self.actor_name, namespace=self.namespace)
        except ValueError:
            return None

    def _bootstrap(self, bootstrap: Bootstrap) -> Any:
        handle = self._find()
        where = f"{self.actor_name!r} in Ray namespace {self.namespace!r}"
        if handle is None and bootstrap is False:
            raise DataPlaneError(
                f"no {self.WHAT} named {where}; create one first with build_data_plane_client(cfg, "
                "bootstrap=True) (or 'auto') in the driver, then attach from workers with bootstrap=False"
            )
        if handle is not None and bootstrap is True:
            raise DataPlaneError(
                f"a {self.WHAT} named {where} already exists; attach with bootstrap=False/'auto' or pick "
                f"another {self.NAME_KWARG}"
            )
        if handle is None:
            try:
                return self._create()
            except DataPlaneError:
                raise
            except ValueError as e:
                # Ray refuses a taken name: another process created it meanwhile. Attach to theirs.
                self._teardown()
                if bootstrap != "auto" or (handle := self._find()) is None:
                    raise DataPlaneError(f"creating the {self.WHAT} {where} failed: {e}") from e
        return self._attach(handle)

    @abstractmethod
    def _create(self) -> Any:
        """Create the named actor (and its helpers), set ``owns_store``, wait until it serves.

        Raises:
            ValueError: the name is taken (Ray's error); anything created so far stays recorded
                for :meth:`_teardown`.
            DataPlaneError: anything else that stops the store from starting.
        """

    @abstractmethod
    def _attach(self, handle: Any) -> Any:
        """Wait until the existing named actor ``handle`` serves (bounded by bootstrap_timeout_s)."""

    @abstractmethod
    def _teardown(self) -> None:
        """Kill the actors this client created (none when it only attached), if Ray is still up;
        idempotent, must not raise."""

    @abstractmethod
    def _disconnect(self) -> None:
        """Release this client's own resources at close (before :meth:`_teardown`); must not raise."""

    # ------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Disconnect; the client that created the store also kills its actors. Idempotent.

        Shuts Ray down only if this client started it.
        """
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._disconnect()
        finally:
            self._teardown()
            if self.started_ray and ray.is_initialized():
                ray.shutdown()

    def _check_open(self) -> None:
        if self._closed:
            raise DataPlaneError(f"{type(self).__name__} is closed")
