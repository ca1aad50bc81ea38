"""FP8 weights for a refit: the sender quantizes, the wire carries FP8 bytes plus their scales.

A generator that runs FP8 weights (vLLM's ``fp8`` quantization) takes a refit in the form an
FP8 checkpoint stores: each quantized matrix ``W`` [N, K] as ``float8_e4m3fn`` bytes under its
own name, followed by its scale, the factor that multiplies the bytes back to ``W``:

* per tensor (``block=None``): ``<name>_scale`` (``x.weight`` -> ``x.weight_scale``), one fp32
  value of shape ``[1]``: ``amax(|W|) / 448``;
* block-wise (``block=(bn, bk)``): ``<name>_scale_inv``, fp32 of shape
  ``[ceil(N / bn), ceil(K / bk)]``, one factor per ``bn x bk`` block (DeepSeek-V3's layout;
  "inv" because it undoes the division of quantizing).

That is about half the bytes of a bf16 refit (a quarter of fp32) for the quantized matrices;
everything else travels as it is. :class:`Fp8Source` wraps a sender's ``NamedTensors`` and
quantizes into buffers it keeps, so every transport sees the same tensors at every refit (a
CUDA IPC sender maps them once); :func:`fp8_layout` is the layout both ends agree on.
Quantization is round-to-nearest with saturation at +-448, in fp32.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from nemo_dataplane.refit.protocol import NamedTensors, current_tensors

__all__ = ["FP8_DTYPE", "FP8_MAX", "Fp8Scheme", "Fp8Source", "dequantize", "fp8_layout"]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# An all-zero matrix or block gets this scale, not 0 (the bytes are 0 either way; 0 would divide).
_TINY = 1e-12

Shapes = Mapping[str, tuple[Sequence[int], torch.dtype | str]]


@dataclass(frozen=True)
class Fp8Scheme:
    """One scale per matrix (``block=None``) or one per ``block = (rows, cols)`` tile."""

    block: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.block is not None and (len(self.block) != 2 or min(self.block) < 1):
            raise ValueError(f"fp8 block must be two positive sizes (rows, cols), got {self.block}")

    def scale_name(self, name: str) -> str:
        """``x.weight`` -> ``x.weight_scale`` (per tensor) or ``x.weight_scale_inv`` (blocks)."""
        return f"{name}_scale_inv" if self.block is not None else f"{name}_scale"

    def scale_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """The scale's shape for a matrix of ``shape`` [N, K]."""
        if len(shape) != 2:
            raise ValueError(f"fp8 quantizes matrices, got shape {tuple(shape)}")
        if self.block is None:
            return (1,)
        (n, k), (bn, bk) = shape, self.block
        return (-(-int(n) // bn), -(-int(k) // bk))

    def quantize(
        self, w: torch.Tensor, out: torch.Tensor | None = None, scale_out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q, scale)`` of matrix ``w``, written into ``out`` / ``scale_out`` when given."""
        if w.dim() != 2:
            raise ValueError(f"fp8 quantizes matrices, got shape {tuple(w.shape)}")
        w32 = w.detach().float()
        if self.block is None:
            scale = (w32.abs().amax().clamp(min=_TINY) / FP8_MAX).reshape(1)
            q = (w32 / scale).clamp(-FP8_MAX, FP8_MAX)
        else:
            tiles, (n, k) = _tiles(w32, self.block), w32.shape
            scale = tiles.abs().amax(dim=(1, 3)).clamp(min=_TINY) / FP8_MAX
            q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
            q = q.reshape(tiles.shape[0] * tiles.shape[1], -1)[:n, :k]
        q_out = q.to(FP8_DTYPE) if out is None else out.copy_(q)
        s_out = scale if scale_out is None else scale_out.copy_(scale)
        return q_out, s_out


def _tiles(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``w`` zero-padded to whole blocks, as [N / bn, bn, K / bk, bk]."""
    (n, k), (bn, bk) = w.shape, block
    pn, pk = -(-n // bn) * bn, -(-k // bk) * bk
    if (pn, pk) != (n, k):
        w = torch.nn.functional.pad(w, (0, pk - k, 0, pn - n))
    return w.reshape(pn // bn, bn, pk // bk, bk)


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None) -> torch.Tensor:
    """``q`` (fp8) times its ``scale`` (per tensor, or per ``block`` tile), in fp32."""
    q32 = q.float()
    if block is None:
        return q32 * scale.float().reshape(())
    n, k = q32.shape
    tiles = _tiles(q32, block) * scale.float()[:, None, :, None]
    return tiles.reshape(tiles.shape[0] * tiles.shape[1], -1)[:n, :k]


def fp8_layout(shapes: Shapes, targets: Collection[str], scheme: Fp8Scheme) -> dict[str, tuple[tuple[int, ...], str]]:
    """The layout a sender built by :class:`Fp8Source` announces: ``shapes`` in their order, each
    of ``targets`` as ``float8_e4m3fn`` followed by its scale (fp32). Dtypes as names.

    Raises:
        ValueError: a target is missing from ``shapes`` or is not a matrix (names it).
    """
    missing = sorted(set(targets) - set(shapes))
    if missing:
        raise ValueError(f"fp8 targets not among the weights: {missing[:5]}")
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for name, (shape, dtype) in shapes.items():
        dims = tuple(int(s) for s in shape)
        if name in targets:
            if len(dims) != 2:
                raise ValueError(f"fp8 target {name!r} has shape {dims}; only matrices are quantized")
            out[name] = (dims, "float8_e4m3fn")
            out[scheme.scale_name(name)] = (scheme.scale_shape(dims), "float32")
        else:
            out[name] = (dims, str(dtype).removeprefix("torch."))
    return out


class Fp8Source:
    """A sender's ``NamedTensors`` with each of ``targets`` replaced by its FP8 bytes and, right
    after it, its scale; every other tensor passes through. Each call requantizes the current
    weights into the same buffers (allocated on the first call, on each weight's device), so the
    tensors a transport holds stay valid from one refit to the next."""

    def __init__(self, named: NamedTensors, targets: Collection[str], scheme: Fp8Scheme) -> None:
        self._named, self._targets, self.scheme = named, frozenset(targets), scheme
        self._buffers: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self) -> Iterator[tuple[str, torch.Tensor]]:
        tensors = current_tensors(self._named)
        missing = sorted(self._targets - tensors.keys())
        if missing:
            raise ValueError(f"fp8 targets not among the sender's weights: {missing[:5]}")
        with torch.no_grad():
            for name, t in tensors.items():
                if name not in self._targets:
                    yield name, t
                    continue
                bufs = self._buffers.get(name)
                if bufs is None or bufs[0].shape != t.shape or bufs[0].device != t.device:
                    bufs = (
                        torch.empty(t.shape, dtype=FP8_DTYPE, device=t.device),
                        torch.empty(self.scheme.scale_shape(t.shape), dtype=torch.float32, device=t.device),
                    )
                    self._buffers[name] = bufs
                self.scheme.quantize(t, *bufs)
                yield name, bufs[0]
                yield self.scheme.scale_name(name), bufs[1]
