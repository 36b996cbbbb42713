"""Point-to-point transfers between pipeline stages.

One call of :func:`exchange` issues a whole batch of sends and receives as one
``torch.distributed.batch_isend_irecv`` (NCCL needs a send and the matching
receive of the opposite direction in one group, or the two ranks deadlock) and
waits for it. Ops are issued in the order given: messages between a pair of
ranks match in order, which the schedule validator relies on.

A message is a tuple of tensors. The receiver must know what to allocate:
either from a fixed ``TensorSpec`` (the usual case: [s, b, h] in the pipeline
dtype) or, with ``variable_seq_lengths``, from a small header of int64 sent
first ("shape negotiation"), which carries the count, dtype and shape of each
tensor so microbatches of different lengths and tuples of tensors can pass.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

MAX_TENSORS = 8
MAX_DIMS = 6
_HEADER_LEN = 1 + MAX_TENSORS * (2 + MAX_DIMS)
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool,
           torch.uint8, torch.int8, torch.int16]


@dataclass(frozen=True)
class TensorSpec:
    """What a receiver allocates for one message: one (shape, dtype) per tensor."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]

    @staticmethod
    def of(tensors: Sequence[torch.Tensor]) -> "TensorSpec":
        return TensorSpec(tuple(tuple(t.shape) for t in tensors), tuple(t.dtype for t in tensors))

    def empty(self, device: torch.device, requires_grad: bool = False) -> tuple[torch.Tensor, ...]:
        return tuple(
            torch.empty(s, dtype=d, device=device, requires_grad=requires_grad and d.is_floating_point)
            for s, d in zip(self.shapes, self.dtypes)
        )


def encode_header(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Count, dtype and shape of each tensor, packed in a fixed-size int64 tensor."""
    if len(tensors) > MAX_TENSORS:
        raise ValueError(f"a pipeline message holds at most {MAX_TENSORS} tensors, got {len(tensors)}")
    header = torch.zeros(_HEADER_LEN, dtype=torch.int64)
    header[0] = len(tensors)
    for i, t in enumerate(tensors):
        if t.dim() > MAX_DIMS:
            raise ValueError(f"pipeline tensors have at most {MAX_DIMS} dims, got shape {tuple(t.shape)}")
        if t.dtype not in _DTYPES:
            raise ValueError(f"dtype {t.dtype} cannot be sent between pipeline stages")
        base = 1 + i * (2 + MAX_DIMS)
        header[base] = _DTYPES.index(t.dtype)
        header[base + 1] = t.dim()
        header[base + 2: base + 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return header.to(device)


def decode_header(header: torch.Tensor) -> TensorSpec:
    h = header.cpu().tolist()
    shapes, dtypes = [], []
    for i in range(h[0]):
        base = 1 + i * (2 + MAX_DIMS)
        ndim = h[base + 1]
        dtypes.append(_DTYPES[h[base]])
        shapes.append(tuple(h[base + 2: base + 2 + ndim]))
    return TensorSpec(tuple(shapes), tuple(dtypes))


@dataclass
class Transfer:
    """One message of a batch: send ``tensors`` to ``peer``, or receive into freshly allocated ones."""

    op: str  # "send" | "recv"
    peer: int  # global rank
    tensors: Optional[tuple[torch.Tensor, ...]] = None  # for sends; filled in for receives
    spec: Optional[TensorSpec] = None  # for receives with fixed shapes
    requires_grad: bool = False  # received activations need it, received gradients don't
    negotiate: bool = False  # send/receive a shape header first (variable_seq_lengths)


_HEADER_TAG = 1  # headers and data match separately where the backend honours tags (gloo)


def exchange(transfers: list[Transfer], group: Optional[dist.ProcessGroup], device: torch.device) -> None:
    """Run a batch of transfers (in order) and wait; received tensors land in ``transfer.tensors``.

    Transfers marked ``negotiate`` first exchange headers, in a batch of their own
    holding the same ops in the same order, so it is as deadlock-free as the data batch.
    """
    if not transfers:
        return
    negotiated = [t for t in transfers if t.negotiate]
    if negotiated:
        headers = []
        ops = []
        for t in negotiated:
            if t.op == "send":
                ops.append(dist.P2POp(dist.isend, encode_header(t.tensors, device), t.peer, group, _HEADER_TAG))
            else:
                h = torch.empty(_HEADER_LEN, dtype=torch.int64, device=device)
                headers.append((t, h))
                ops.append(dist.P2POp(dist.irecv, h, t.peer, group, _HEADER_TAG))
        _wait(dist.batch_isend_irecv(ops))
        for t, h in headers:
            t.spec = decode_header(h)

    ops = []
    for t in transfers:
        if t.op == "send":
            ops.extend(dist.P2POp(dist.isend, x.contiguous(), t.peer, group) for x in t.tensors)
        else:
            if t.spec is None:
                raise ValueError("a receive needs a TensorSpec (tensor_shape) or variable_seq_lengths=True")
            t.tensors = t.spec.empty(device, requires_grad=False)
            ops.extend(dist.P2POp(dist.irecv, x, t.peer, group) for x in t.tensors)
    _wait(dist.batch_isend_irecv(ops))
    for t in transfers:
        if t.op == "recv" and t.requires_grad:
            t.tensors = tuple(x.requires_grad_() if x.is_floating_point() else x for x in t.tensors)


def _wait(works) -> None:
    for w in works:
        w.wait()
