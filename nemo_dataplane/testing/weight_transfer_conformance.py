"""The weight-transfer contract as a reusable pytest suite: subclass :class:`WeightTransferConformance`.

A family (``nemo_dataplane.refit.factory.register_weight_transfer``) passes when every test
here passes against it. In your own test file::

    from nemo_dataplane.refit import WeightTransferConfig
    from nemo_dataplane.testing.weight_transfer_conformance import WeightTransferConformance

    class TestMyTransport(WeightTransferConformance):
        config = WeightTransferConfig(family="my-family", transport="rdma")
        # imported in every rank process before each scenario: it registers the family
        setup_modules = ("my_pkg.refit_family",)

Each scenario builds the family's sender (group rank 0) and receivers (the other ranks) with
``build_weight_sender`` / ``build_weight_receiver`` on CPU over a gloo ``StatelessProcessGroup``,
one process per rank, and checks what a trainer and a generator rely on:

* weights arrive bit-exact (random bit patterns, NaN payloads included; several dtypes, a
  0-dim tensor, strided tensors on both sides), written in place into the receiver's tensors;
* a second refit of changed weights arrives too, and ``receive_weights()`` returns its version
  (one beyond 32 bits) and stores it in ``version``;
* ``close()`` is idempotent, and ``prepare_refit_info()`` after it sets up again;
* a name, shape or dtype mismatch on one receiver raises ``RefitMismatchError`` on every rank,
  naming the parameter, before any weights move;
* a sender whose tensors changed after prepare makes every rank raise ``RefitError`` without
  touching the receivers' tensors, and the next refit works on the same group;
* a refit before ``prepare_refit_info()`` raises ``RefitError``.

The rank processes are forked once from a server that has torch loaded and are reused by every
scenario and every suite class of the test session (each scenario gets a fresh group); a
scenario's results are computed once per class and shared by the tests that read them.
"""

from __future__ import annotations

import sys
from typing import Any, ClassVar, cast

from nemo_dataplane.refit.config import WeightTransferConfig
from nemo_dataplane.refit.protocol import RefitError, RefitMismatchError
from nemo_dataplane.testing.weight_transfer_scenarios import (
    MISMATCHED,
    STRIDED_DST,
    VERSION_AFTER_CLOSE,
    VERSIONS,
    free_port,
    model_tensors,
    rank_processes,
    shutdown_ranks,
)

__all__ = ["WeightTransferConformance", "shutdown_ranks"]


class WeightTransferConformance:
    """Subclass with ``config`` set (and ``setup_modules`` if importing a module registers the
    family). ``receivers``: receiver ranks (group rank 0 sends); ``timeout_s``: the group's
    bound on every wait; ``limit_s``: how long a scenario may run before it counts as hung.

    Each ``test_*`` calls the matching ``check_*``, which raises ``AssertionError`` saying what
    the family got wrong; call them directly to use the suite outside a test class
    (``for_config``)."""

    config: ClassVar[WeightTransferConfig]
    setup_modules: ClassVar[tuple[str, ...]] = ()
    receivers: ClassVar[int] = 2
    timeout_s: ClassVar[float] = 30.0
    limit_s: ClassVar[float] = 300.0
    _cache: ClassVar[dict[str, dict[int, Any]]]  # scenario -> rank -> result, per suite class

    @classmethod
    def for_config(
        cls, config: WeightTransferConfig, *, setup_modules: tuple[str, ...] = (), receivers: int = 2
    ) -> WeightTransferConformance:
        """A suite for ``config`` outside a pytest class (its results cached on its own)."""
        suite = type(
            f"{cls.__name__}[{config.family}]",
            (cls,),
            {"config": config, "setup_modules": tuple(setup_modules), "receivers": receivers},
        )
        return cast(WeightTransferConformance, suite())  # a subclass of cls

    # -- running scenarios

    def _results(self, name: str) -> dict[int, Any]:
        cache: dict[str, dict[int, Any]] | None = type(self).__dict__.get("_cache")
        if cache is None:
            cache = {}
            type(self)._cache = cache  # per suite class: a subclass never reads its base's
        if name not in cache:
            world = 1 + self.receivers
            kw = {
                "name": name,
                "world": world,
                "port": free_port(),
                "config": self.config,
                "setup_modules": tuple(self.setup_modules),
                "sys_path": list(sys.path),
                "timeout": self.timeout_s,
            }
            cache[name] = rank_processes(world).run(world, self.limit_s, kw)
        return cache[name]

    def _ranks_of(self, name: str) -> dict[int, dict[str, Any]]:
        res = self._results(name)
        crashed = {r: v for r, v in res.items() if isinstance(v, str)}
        assert not crashed, "\n".join(crashed.values())
        return res

    @staticmethod
    def _raised(entry: Any, kind: type[BaseException], what: str) -> dict[str, Any]:
        assert isinstance(entry, dict) and "error" in entry, f"{what}: expected {kind.__name__}, nothing was raised"
        assert kind.__name__ in entry["mro"], (
            f"{what}: expected {kind.__name__}, got {entry['error']}: {entry['msg']}\n{entry['traceback']}"
        )
        return entry

    def _refit(self, index: int) -> dict[int, dict[str, Any]]:
        """Per receiver rank: what refit ``index`` of the roundtrip delivered (raising if it failed)."""
        out = {}
        for r, res in self._ranks_of("roundtrip").items():
            refits = res["refits"]
            failed = next((x for x in refits if "error" in x), None)
            assert len(refits) > index and "error" not in refits[index], (
                f"rank {r}: refit {index} did not complete: {failed['error'] if failed else 'no record'}: "
                f"{failed['msg'] if failed else ''}\n{failed['traceback'] if failed else ''}"
            )
            if r:
                out[r] = refits[index]
        return out

    # -- checks

    def check_weights_arrive_bit_exact(self) -> None:
        for r, got in self._refit(0).items():
            assert got["wrong"] == [], f"receiver rank {r}: these tensors differ from the sender's bits: {got['wrong']}"

    def check_a_second_refit_delivers_new_weights_and_its_version(self) -> None:
        assert model_tensors(0)[STRIDED_DST].ne(model_tensors(1)[STRIDED_DST]).any()  # the refits differ
        for index, expected in enumerate(VERSIONS):
            for r, got in self._refit(index).items():
                assert got["returned"] == expected, (
                    f"receiver rank {r}: refit {index} returned version {got['returned']!r}, the sender sent {expected}"
                )
                assert got["attr"] == expected, (
                    f"receiver rank {r}: .version is {got['attr']!r} after refit {index}, expected {expected}"
                )
                assert got["wrong"] == [], (
                    f"receiver rank {r}: refit {index} left stale or wrong bits in {got['wrong']}"
                )

    def check_receiver_tensors_are_written_in_place(self) -> None:
        for index in range(len(VERSIONS)):
            for r, got in self._refit(index).items():
                assert got["moved"] == [], (
                    f"receiver rank {r}: refit {index} rebound {got['moved']} to new storage "
                    "instead of writing into the tensors it was given"
                )

    def check_close_is_idempotent_and_prepare_sets_up_again(self) -> None:
        for r, res in self._ranks_of("roundtrip").items():
            assert res["close"] is None, (
                f"rank {r}: close() twice raised {res['close']['error']}: {res['close']['msg']}"
            )
        for r, got in self._refit(len(VERSIONS)).items():
            assert got["after_close"] and got["returned"] == VERSION_AFTER_CLOSE and got["wrong"] == [], (
                f"receiver rank {r}: after close() and prepare_refit_info(): {got}"
            )

    def _check_mismatch(self, kind: str, names: tuple[str, ...]) -> None:
        res = self._ranks_of(f"mismatch-{kind}")
        for r, out in res.items():
            err = self._raised(
                out["prepare"], RefitMismatchError, f"rank {r}, a {kind} mismatch on receiver rank {len(res) - 1}"
            )
            assert any(n in err["msg"] for n in names), (
                f"rank {r}: the {kind} mismatch error does not name {' or '.join(names)}: {err['msg']}"
            )
            if r:
                assert out["untouched"], f"receiver rank {r}: tensors changed although the handshake failed"

    def check_a_name_mismatch_raises_naming_the_parameter(self) -> None:
        self._check_mismatch("name", (MISMATCHED, MISMATCHED + "_renamed"))

    def check_a_shape_mismatch_raises_naming_the_parameter(self) -> None:
        self._check_mismatch("shape", (MISMATCHED,))

    def check_a_dtype_mismatch_raises_naming_the_parameter(self) -> None:
        self._check_mismatch("dtype", (MISMATCHED,))

    def check_a_changed_sender_aborts_every_rank_and_the_next_refit_works(self) -> None:
        res = self._ranks_of("abort")
        for r, out in res.items():
            assert "prepare" not in out, f"rank {r}: prepare failed: {out['prepare']['msg']}"
            first = out["first"]
            assert first is not None and "error" not in first, f"rank {r}: refit 0 failed: {first}"
            err = self._raised(out["failed"], RefitError, f"rank {r}, refit 1 after the sender's tensor changed shape")
            if r:
                assert err["changed"] == [], f"receiver rank {r}: an aborted refit changed {err['changed']}"
            nxt = out["next"]
            assert nxt is not None and "error" not in nxt, (
                f"rank {r}: the refit after an abort failed: {nxt and nxt.get('msg')}\n{nxt and nxt.get('traceback')}"
            )
            if r:
                assert nxt["version"] == 12 and nxt["wrong"] == [], f"receiver rank {r}: after the abort got {nxt}"

    def check_a_refit_before_prepare_raises(self) -> None:
        for r, out in self._ranks_of("before-prepare").items():
            self._raised(
                out["raised"],
                RefitError,
                f"rank {r}, {'send' if r == 0 else 'receive'}_weights() before prepare_refit_info()",
            )

    # -- the tests (one per check)

    def test_weights_arrive_bit_exact(self) -> None:
        self.check_weights_arrive_bit_exact()

    def test_a_second_refit_delivers_new_weights_and_its_version(self) -> None:
        self.check_a_second_refit_delivers_new_weights_and_its_version()

    def test_receiver_tensors_are_written_in_place(self) -> None:
        self.check_receiver_tensors_are_written_in_place()

    def test_close_is_idempotent_and_prepare_sets_up_again(self) -> None:
        self.check_close_is_idempotent_and_prepare_sets_up_again()

    def test_a_name_mismatch_raises_naming_the_parameter(self) -> None:
        self.check_a_name_mismatch_raises_naming_the_parameter()

    def test_a_shape_mismatch_raises_naming_the_parameter(self) -> None:
        self.check_a_shape_mismatch_raises_naming_the_parameter()

    def test_a_dtype_mismatch_raises_naming_the_parameter(self) -> None:
        self.check_a_dtype_mismatch_raises_naming_the_parameter()

    def test_a_changed_sender_aborts_every_rank_and_the_next_refit_works(self) -> None:
        self.check_a_changed_sender_aborts_every_rank_and_the_next_refit_works()

    def test_a_refit_before_prepare_raises(self) -> None:
        self.check_a_refit_before_prepare_raises()
