"""The conformance suite catches a backend that breaks the contract, naming the clause.

Backends, each the reference store with one clause broken, run through the real suite
(nemo_dataplane.testing.conformance) in a pytest subprocess next to the unbroken reference:
each fails the test that states its clause (and the unbroken reference passes), with a message
naming what differs. The suites get pytest's assertion rewriting (nemo_dataplane.testing).

``RotatesAbove64`` returns the rows of any get of more than 64 keys rotated by one: it passes
every small-read test (as it passed the whole suite before the large reads), and the large-read
test fails naming the first row at fault, its key, and whose row it holds. Two suites that
cannot run the cross-process tests (no ``remote_config`` defined; Ray not initialized) fail
them, saying why, instead of skipping.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

BROKEN = textwrap.dedent('''
    import pytest
    import torch

    from nemo_dataplane.adapters.memory import InMemoryClient
    from nemo_dataplane.meta import KVBatchMeta
    from nemo_dataplane.testing.conformance import DataPlaneConformance


    class Sorted(InMemoryClient):
        """Returns rows in key order, not in the order asked."""

        def kv_batch_get(self, meta_or_keys, select_fields, partition_id=None):
            if isinstance(meta_or_keys, KVBatchMeta):
                partition_id, keys = meta_or_keys.partition_id, list(meta_or_keys.keys)
            else:
                keys = list(meta_or_keys)
            return super().kv_batch_get(sorted(keys), select_fields, partition_id=partition_id)


    class ClearKeepsKeys(InMemoryClient):
        """kv_clear of listed keys does nothing."""

        def kv_clear(self, keys, partition_id):
            if keys is None:
                super().kv_clear(keys, partition_id)


    class MissingIsZero(InMemoryClient):
        """A missing key reads as zeros instead of raising."""

        def kv_batch_get(self, meta_or_keys, select_fields, partition_id=None):
            keys = list(meta_or_keys.keys if isinstance(meta_or_keys, KVBatchMeta) else meta_or_keys)
            pid = meta_or_keys.partition_id if isinstance(meta_or_keys, KVBatchMeta) else partition_id
            held = set(self.kv_list(pid).keys)
            if all(k in held for k in keys):
                return super().kv_batch_get(meta_or_keys, select_fields, partition_id=partition_id)
            from tensordict import TensorDict
            return TensorDict({f: torch.zeros(len(keys)) for f in select_fields}, batch_size=[len(keys)])


    class PartitionsNeverForget(InMemoryClient):
        """kv_partitions lists every partition ever written to, emptied ones too."""

        def kv_batch_put(self, keys, partition_id, fields, tags=None):
            meta = super().kv_batch_put(keys, partition_id, fields, tags)
            self.__dict__.setdefault("seen", []).append(partition_id)
            return meta

        def kv_partitions(self):
            return list(dict.fromkeys(self.__dict__.get("seen", [])))


    class RotatesAbove64(InMemoryClient):
        """Gets of more than 64 keys come back rotated by one row."""

        def kv_batch_get(self, meta_or_keys, select_fields, partition_id=None):
            out = super().kv_batch_get(meta_or_keys, select_fields, partition_id=partition_id)
            n = out.batch_size[0]
            return out[torch.roll(torch.arange(n), 1)] if n > 64 else out


    class IntTagsComeBackAsFloats(InMemoryClient):
        """Lists tags as a JSON store with one number type would: every int a float."""

        def kv_list(self, partition_id):
            meta = super().kv_list(partition_id)
            tags = [{k: float(v) if type(v) is int else v for k, v in t.items()} for t in meta.tags]
            return KVBatchMeta(keys=meta.keys, tags=tags, partition_id=meta.partition_id, fields=meta.fields)


    class CloseDoesNothing(InMemoryClient):
        """close() leaves the client working."""

        def close(self):
            pass


    def _suite(cls, **hooks):
        class Suite(DataPlaneConformance):
            @pytest.fixture
            def client(self):
                c = cls()
                yield c
                c.close()

            def remote_config(self):
                return None

            def fresh_config(self):
                return {"backend": f"test_broken_backends:{cls.__name__}"}
        for name, fn in hooks.items():
            setattr(Suite, name, fn)
        Suite.__name__ = f"Test{cls.__name__}"
        return Suite


    TestReference = _suite(InMemoryClient)
    TestRotatesAbove64 = _suite(RotatesAbove64)
    TestIntTagsComeBackAsFloats = _suite(IntTagsComeBackAsFloats)
    TestCloseDoesNothing = _suite(CloseDoesNothing)
    TestNoRemoteConfig = _suite(InMemoryClient, remote_config=DataPlaneConformance.remote_config)
    TestNoRay = _suite(InMemoryClient, remote_config=lambda self: {"backend": "memory"})
    TestSorted = _suite(Sorted)
    TestClearKeepsKeys = _suite(ClearKeepsKeys)
    TestMissingIsZero = _suite(MissingIsZero)
    TestPartitionsNeverForget = _suite(PartitionsNeverForget)
''')

CLAUSES = (
    "test_rows_come_back_in_the_order_asked",
    "test_list_clear_semantics",
    "test_missing_keys_raise_key_error_naming_them",
    "test_partitions_lists_exactly_the_partitions_holding_keys",
    "test_large_gets_return_every_row_in_the_order_asked",
    "test_tag_values_round_trip_with_their_types",
    "test_after_close_every_method_raises_and_a_second_close_is_harmless",
    "test_put_in_one_actor_read_in_another",
)


def test_each_broken_clause_fails_the_test_stating_it_with_a_message_naming_what_differs(tmp_path: Path) -> None:
    (tmp_path / "test_broken_backends.py").write_text(BROKEN)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-rA",
            "--import-mode=importlib",
            "-k",
            " or ".join(CLAUSES),
            str(tmp_path / "test_broken_backends.py"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={
            # tmp_path: fresh_config names the broken classes as "test_broken_backends:Class"
            "PYTHONPATH": f"{REPO}{os.pathsep}{tmp_path}",
            "PATH": "/usr/bin:/bin",
            "OMP_NUM_THREADS": "1",
            "COLUMNS": "400",
        },
    )
    out = proc.stdout + proc.stderr
    failed = {f"{c}::{t}": ln for ln in out.splitlines() for c, t in re.findall(r"^FAILED \S+::(Test\w+)::(\w+)", ln)}
    passed = set(re.findall(r"^PASSED \S+::(Test\w+::\w+)", out, re.M))
    # The unbroken reference passes every clause (an in-process store: the cross-process one is skipped).
    assert {f"TestReference::{c}" for c in CLAUSES if "actor" not in c} <= passed, out[-4000:]
    assert not any(k.startswith("TestReference::") for k in failed), out[-4000:]
    # Each broken backend fails the test stating its clause (others that rely on the same
    # behaviour may fail too), and the message names what differs.
    sorted_fail = failed.get("TestSorted::test_rows_come_back_in_the_order_asked", "")
    assert "ids: " in sorted_fail, out[-4000:]  # offsets or values, per the layout that differs first
    clear_fail = failed.get("TestClearKeepsKeys::test_list_clear_semantics", "")
    assert "('c', 'a', 'b', 'd')" in clear_fail, out[-4000:]
    assert failed.keys() >= {"TestMissingIsZero::test_missing_keys_raise_key_error_naming_them"}, out[-4000:]
    assert "DID NOT RAISE" in failed["TestMissingIsZero::test_missing_keys_raise_key_error_naming_them"]
    never_forget = failed.get(
        "TestPartitionsNeverForget::test_partitions_lists_exactly_the_partitions_holding_keys", ""
    )
    assert "-b'] == ['conf-" in never_forget, out[-4000:]  # still lists the emptied partition next to b
    assert "TestPartitionsNeverForget::test_list_clear_semantics" in passed
    # A clause a backend did not break still passes for it.
    assert "TestClearKeepsKeys::test_rows_come_back_in_the_order_asked" in passed
    assert "TestSorted::test_missing_keys_raise_key_error_naming_them" in passed
    # Rows rotated above 64 keys: every small read passes, the large reads fail naming the row,
    # its key and whose row it holds (the uid column says: the key before it, rotated by one).
    assert "TestRotatesAbove64::test_rows_come_back_in_the_order_asked" in passed, out[-4000:]
    rotated = failed.get("TestRotatesAbove64::test_large_gets_return_every_row_in_the_order_asked", "")
    assert re.search(r"rows came back for other keys: row 0, key 'r\d{4}', holds the row of key 'r\d{4}'", rotated), (
        out[-4000:]
    )
    # Tags: an int listed back as a float is named, with both values.
    floats = failed.get("TestIntTagsComeBackAsFloats::test_tag_values_round_trip_with_their_types", "")
    assert "kv_list: tags changed value or type" in floats and "'zero': (0.0, 0)" in floats, out[-4000:]
    assert "TestIntTagsComeBackAsFloats::test_large_gets_return_every_row_in_the_order_asked" in passed
    # A close that does nothing: the first method called after it is named.
    unclosed = failed.get(
        "TestCloseDoesNothing::test_after_close_every_method_raises_and_a_second_close_is_harmless", ""
    )
    assert "DID NOT RAISE" in unclosed, out[-4000:]
    # What the suite cannot run fails, saying why; an in-process store's skip says so.
    no_cfg = failed.get("TestNoRemoteConfig::test_put_in_one_actor_read_in_another", "")
    assert "does not define remote_config()" in no_cfg, out[-4000:]
    no_ray = failed.get("TestNoRay::test_put_in_one_actor_read_in_another", "")
    assert "Ray is not initialized in the test process: call ray.init()" in no_ray, out[-4000:]
    assert re.search(r"SKIPPED .*remote_config\(\) is None: an in-process store", out), out[-4000:]
