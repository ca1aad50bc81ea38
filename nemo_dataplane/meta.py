"""`KVBatchMeta`: the metadata that travels between driver and workers instead of tensors.

It mirrors ``transfer_queue.metadata.KVBatchMeta`` field for field (``keys``, ``tags``,
``partition_id``, ``fields``, ``extra_info``) so a meta can cross into TransferQueue's own
clients and back without loss. Unlike TransferQueue's class it is frozen: every transform
returns a new meta and never touches the store.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nemo_dataplane.errors import NemoDataplaneError

if TYPE_CHECKING:  # pragma: no cover - typing only
    import transfer_queue.metadata


def _duplicates(items: Iterable[str]) -> list[str]:
    seen: set[str] = set()
    dups: list[str] = []
    for item in items:
        if item in seen and item not in dups:
            dups.append(item)
        seen.add(item)
    return dups


class MissingKeysError(NemoDataplaneError, KeyError, RuntimeError):
    """Keys asked for are not in the meta: ``KeyError`` for this library's callers,
    ``RuntimeError`` for callers written against TransferQueue's ``KVBatchMeta``."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


def _values_equal(a: Any, b: Any) -> bool:
    """``a == b`` for ``extra_info`` values, tensors and arrays compared element-wise."""
    if type(a) is not type(b):
        return False
    if hasattr(a, "shape") and hasattr(a, "dtype"):
        try:
            import torch

            if isinstance(a, torch.Tensor):
                return bool(torch.equal(a, b))
        except ImportError:  # pragma: no cover - torch is a dependency
            pass
        import numpy as np

        return bool(np.array_equal(a, b))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an uncomparable value is a conflict, not a crash
        return False


# Tag values of these types are immutable: a shallow copy of a dict holding only them is as
# private as a deep copy, at a fraction of the cost (deepcopy dominated metas of 4096 keys).
_ATOMIC = frozenset({int, float, str, bool, bytes, type(None)})


def _copy_tag(tag: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(tag)
    if all(type(v) in _ATOMIC for v in out.values()):
        return out
    return copy.deepcopy(out)


@dataclass(frozen=True)
class KVBatchMeta:
    """Keys of one batch in one partition, with per-key tags and batch-level info.

    Contract:
        * ``keys`` are unique strings; ``tags`` holds exactly one dict per key, aligned by index.
        * ``fields`` names the columns known to be stored for these keys (``None``: unknown).
        * ``extra_info`` carries batch-level plans (packing, padding) that ride with the batch.
        * Tags and ``extra_info`` are deep-copied on construction, so a meta never aliases
          another meta's dicts; treat them as read-only.

    Raises:
        TypeError: ``keys`` or ``fields`` is one ``str``/``bytes`` (it would split into characters).
        ValueError: on misaligned tags, duplicated keys or fields, or non-string keys.
    """

    keys: tuple[str, ...] = ()
    tags: tuple[dict[str, Any], ...] = ()
    partition_id: str | None = None
    fields: tuple[str, ...] | None = None
    extra_info: dict[str, Any] | None = field(default_factory=dict)

    def __post_init__(self) -> None:
        # tuple("abc") is ("a", "b", "c"): one string is a caller's mistake, never three keys.
        for name in ("keys", "fields"):
            value = getattr(self, name)
            if isinstance(value, (str, bytes)):
                raise TypeError(
                    f"KVBatchMeta.{name} must be a sequence of str, got one {type(value).__name__} {value!r} "
                    f"(wrap it: {name}=[{value!r}])"
                )
        keys = tuple(self.keys)
        tags = tuple(self.tags) if self.tags is not None else ()
        # Fast checks first (one C-level pass each); the loops below only name the culprit.
        if not all(type(k) is str for k in keys):
            for i, key in enumerate(keys):
                if not isinstance(key, str):
                    raise ValueError(f"KVBatchMeta.keys[{i}] must be a str, got {type(key).__name__}: {key!r}")
        if len(tags) != len(keys):
            raise ValueError(
                "KVBatchMeta: keys and tags must have same length (one tag dict per key): "
                f"got {len(tags)} tags for {len(keys)} keys"
            )
        for i, tag in enumerate(tags):
            if not isinstance(tag, Mapping):
                raise ValueError(f"KVBatchMeta.tags[{i}] (key {keys[i]!r}) must be a dict, got {type(tag).__name__}")
        if len(set(keys)) != len(keys):
            raise ValueError(f"KVBatchMeta.keys: Got duplicated keys {_duplicates(keys)[:10]}")
        fields = None if self.fields is None else tuple(self.fields)
        if fields is not None:
            dup_fields = _duplicates(fields)
            if dup_fields:
                raise ValueError(f"KVBatchMeta.fields: Got duplicated fields {dup_fields}")
        if self.partition_id is not None and not isinstance(self.partition_id, str):
            raise ValueError(f"KVBatchMeta.partition_id must be a str or None, got {self.partition_id!r}")
        object.__setattr__(self, "keys", keys)
        object.__setattr__(self, "tags", tuple(map(_copy_tag, tags)))
        object.__setattr__(self, "fields", fields)
        object.__setattr__(self, "extra_info", copy.deepcopy(self.extra_info))

    # ------------------------------------------------------------------ views
    def __len__(self) -> int:
        return len(self.keys)

    @property
    def size(self) -> int:
        """Number of keys (TransferQueue's name for ``len``)."""
        return len(self.keys)

    def tag_values(self, name: str) -> list[Any]:
        """The tag ``name`` of every key, in key order.

        Raises:
            KeyError: naming the first keys that lack the tag.
        """
        missing = [k for k, t in zip(self.keys, self.tags) if name not in t]
        if missing:
            raise KeyError(f"tag {name!r} missing on {len(missing)} key(s), e.g. {missing[:5]}")
        return [t[name] for t in self.tags]

    def __repr__(self) -> str:
        head = list(self.keys[:3]) + (["..."] if len(self.keys) > 3 else [])
        return (
            f"KVBatchMeta(n={len(self.keys)}, partition_id={self.partition_id!r}, keys={head}, "
            f"fields={None if self.fields is None else list(self.fields)}, "
            f"extra_info={sorted((self.extra_info or {}).keys())})"
        )

    # ------------------------------------------------------------ transforms
    def _replace(self, **changes: Any) -> KVBatchMeta:
        kwargs: dict[str, Any] = dict(
            keys=self.keys,
            tags=self.tags,
            partition_id=self.partition_id,
            fields=self.fields,
            extra_info=self.extra_info,
        )
        kwargs.update(changes)
        return KVBatchMeta(**kwargs)

    def subset(self, indices: Sequence[int]) -> KVBatchMeta:
        """The keys at ``indices`` in that order (no repeats; negative indices allowed).

        Raises:
            IndexError: an index is out of range.  ValueError: an index repeats.
        """
        n = len(self.keys)
        norm: list[int] = []
        for i in indices:
            j = int(i)
            if not -n <= j < n:
                raise IndexError(f"KVBatchMeta.subset: index {j} out of range for {n} keys")
            norm.append(j % n if n else j)
        dups = _duplicates(str(j) for j in norm)
        if dups:
            raise ValueError(f"KVBatchMeta.subset: repeated indices {dups[:10]}")
        return self._replace(keys=[self.keys[j] for j in norm], tags=[self.tags[j] for j in norm])

    def reorder(self, indices: Sequence[int]) -> KVBatchMeta:
        """A permutation of all keys: ``new.keys[i] == self.keys[indices[i]]``.

        Raises:
            ValueError: ``indices`` is not a permutation of ``range(len(self))``.
        """
        idx = [int(i) for i in indices]
        if len(idx) != len(self.keys):
            raise ValueError(
                f"KVBatchMeta.reorder: indexes length {len(idx)} does not match the batch size {len(self.keys)}"
            )
        if len(set(idx)) != len(idx):
            raise ValueError(f"KVBatchMeta.reorder: Contain duplicate indexes {_duplicates(map(str, idx))[:10]}")
        if sorted(idx) != list(range(len(self.keys))):
            raise ValueError(f"KVBatchMeta.reorder needs a permutation of range({len(self.keys)}), got {idx[:20]}")
        return self.subset(indices)

    def select_keys(self, keys: Sequence[str]) -> KVBatchMeta:
        """The given keys, in the given order.

        Raises:
            ValueError: a key repeats.  MissingKeysError (a ``KeyError`` and a ``RuntimeError``,
            so callers written for either this class or TransferQueue's catch it): naming keys
            not in this meta.
        """
        dups = _duplicates(keys)
        if dups:
            raise ValueError(f"KVBatchMeta.select_keys: Contain duplicate keys {dups[:10]}")
        index = {k: i for i, k in enumerate(self.keys)}
        missing = [k for k in keys if k not in index]
        if missing:
            raise MissingKeysError(f"KVBatchMeta.select_keys: keys {missing[:10]} not found in current batch")
        return self.subset([index[k] for k in keys])

    def chunk(self, n: int) -> list[KVBatchMeta]:
        """Split into ``n`` contiguous parts whose sizes differ by at most one (earlier parts larger).

        Raises:
            ValueError: ``n`` < 1.
        """
        if n < 1:
            raise ValueError(f"KVBatchMeta.chunk: n must be >= 1, got {n}")
        base, extra = divmod(len(self.keys), n)
        out: list[KVBatchMeta] = []
        start = 0
        for i in range(n):
            stop = start + base + (1 if i < extra else 0)
            out.append(self.subset(range(start, stop)))
            start = stop
        return out

    @staticmethod
    def concat(metas: Sequence[KVBatchMeta]) -> KVBatchMeta:
        """Join metas of one partition, keys in order (TransferQueue's semantics).

        Empty metas are skipped before anything is checked; no meta left gives an empty meta.
        Every meta that knows its ``fields`` must know the same set (the result keeps the first
        meta's order); if any meta's fields are unknown (``None``) the result's are too.
        ``extra_info`` is the union of the metas' dicts; a key with two different values is an
        error rather than a silent first-wins.

        Raises:
            ValueError: mixed partitions, different field sets, conflicting ``extra_info``
            values (naming the key), or a key in two metas.
        """
        metas = [m for m in metas if m is not None and len(m) > 0]
        if not metas:
            return KVBatchMeta()
        partitions = {m.partition_id for m in metas}
        if len(partitions) > 1:
            raise ValueError(
                f"KVBatchMeta.concat: Partition do not match for concatenation: {sorted(map(str, partitions))}"
            )
        known = [m.fields for m in metas if m.fields is not None]
        for f in known[1:]:
            if set(f) != set(known[0]):
                raise ValueError(
                    f"KVBatchMeta.concat: Field names do not match for concatenation: {list(known[0])} vs {list(f)}"
                )
        fields = known[0] if known and len(known) == len(metas) else None
        extra: dict[str, Any] = {}
        for m in metas:
            for name, value in (m.extra_info or {}).items():
                if name in extra and not _values_equal(extra[name], value):
                    raise ValueError(f"KVBatchMeta.concat: extra_info key {name!r} has conflicting values across metas")
                extra.setdefault(name, value)
        return metas[0]._replace(
            keys=[k for m in metas for k in m.keys],
            tags=[t for m in metas for t in m.tags],
            fields=fields,
            extra_info=extra,
        )

    def replace_fields(self, fields: Iterable[str] | None) -> KVBatchMeta:
        """The same keys, with ``fields`` replaced (NeMo-RL's ``with_fields`` merges: see ``add_fields``)."""
        return self._replace(fields=None if fields is None else tuple(fields))

    def add_fields(self, fields: Iterable[str]) -> KVBatchMeta:
        """The same keys, with ``fields`` appended to the known fields (no duplicates)."""
        known = list(self.fields or ())
        known += [f for f in fields if f not in known]
        return self._replace(fields=known)

    def with_extra_info(self, **info: Any) -> KVBatchMeta:
        """The same keys, with ``extra_info`` updated by ``info``."""
        merged = dict(self.extra_info or {})
        merged.update(info)
        return self._replace(extra_info=merged)

    def merge_tags(self, tags: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> KVBatchMeta:
        """Merge tags into every key: one dict for all keys, or one dict per key.

        (Not NeMo-RL's ``stamp_tags``, which takes per-key columns; hence the different name.)

        Only the meta changes; write tags to the store with ``kv_batch_put(..., tags=...)``.

        Raises:
            ValueError: a per-key list whose length differs from the number of keys.
        """
        if isinstance(tags, Mapping):
            per_key: Sequence[Mapping[str, Any]] = [tags] * len(self.keys)
        else:
            per_key = list(tags)
            if len(per_key) != len(self.keys):
                raise ValueError(f"merge_tags: got {len(per_key)} tag dicts for {len(self.keys)} keys")
        return self._replace(tags=[{**old, **dict(new)} for old, new in zip(self.tags, per_key)])

    # ------------------------------------------------------ TransferQueue I/O
    def to_transfer_queue(self) -> transfer_queue.metadata.KVBatchMeta:
        """The equivalent ``transfer_queue.metadata.KVBatchMeta`` (lossless)."""
        from transfer_queue.metadata import KVBatchMeta as TQMeta

        return TQMeta(
            keys=list(self.keys),
            tags=[dict(t) for t in self.tags],
            partition_id=self.partition_id,
            fields=None if self.fields is None else list(self.fields),
            extra_info=copy.deepcopy(self.extra_info),
        )

    @classmethod
    def from_transfer_queue(cls, meta: Any) -> KVBatchMeta:
        """Build from a ``transfer_queue.metadata.KVBatchMeta`` (lossless)."""
        return cls(
            keys=tuple(meta.keys),
            tags=tuple(dict(t) for t in meta.tags),
            partition_id=meta.partition_id,
            fields=None if meta.fields is None else tuple(meta.fields),
            extra_info=copy.deepcopy(meta.extra_info),
        )
