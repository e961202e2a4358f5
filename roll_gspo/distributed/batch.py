"""`Batch`: what flows between roles. Tensors share a leading batch dimension; `meta` holds
per-sample Python values (strings, token lists) of the same length."""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np
import torch


def to_wire(tensor: torch.Tensor) -> Tuple[np.ndarray, str]:
    """A tensor as numpy, which Ray serialises as a raw buffer (pickle protocol 5) where a torch
    tensor goes through torch's much slower pickling; numpy has no bfloat16, so those go as
    their int16 bit patterns. Always a CPU array, so a GPU worker's output reaches a GPU-less
    driver."""
    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy(), "bfloat16"
    return tensor.numpy(), ""


def from_wire(array: np.ndarray, tag: str) -> torch.Tensor:
    """The tensor `to_wire` sent. Arrays Ray hands back read-only (object-store memory) are
    shared, not copied: callers copy before writing (torch's loaders and `Batch` all do)."""
    with warnings.catch_warnings():  # torch warns about read-only arrays; see above
        warnings.simplefilter("ignore", UserWarning)
        tensor = torch.from_numpy(array)
    return tensor.view(torch.bfloat16) if tag == "bfloat16" else tensor


@dataclass
class Batch:
    tensors: Dict[str, torch.Tensor] = field(default_factory=dict)
    meta: Dict[str, List[Any]] = field(default_factory=dict)

    def __len__(self) -> int:
        for value in self.tensors.values():
            return value.shape[0]
        for value in self.meta.values():
            return len(value)
        return 0

    def __getitem__(self, key: str) -> Any:
        return self.tensors[key] if key in self.tensors else self.meta[key]

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.meta

    def __reduce__(self):
        # Through Ray: tensors as numpy buffers (see `to_wire`).
        return _batch_from_wire, ({k: to_wire(v) for k, v in self.tensors.items()}, self.meta)

    def __setitem__(self, key: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            self.tensors[key] = value
        else:
            self.meta[key] = list(value)

    def select(self, index: Sequence[int]) -> "Batch":
        index_tensor = torch.as_tensor(list(index), dtype=torch.long)
        return Batch({k: v[index_tensor] for k, v in self.tensors.items()},
                     {k: [v[i] for i in index] for k, v in self.meta.items()})

    def chunk(self, parts: int) -> List["Batch"]:
        """Split into `parts` contiguous pieces whose sizes differ by at most one."""
        size = len(self)
        bounds = [size * i // parts for i in range(parts + 1)]
        return [self.select(range(bounds[i], bounds[i + 1])) for i in range(parts)]

    @staticmethod
    def concat(batches: Sequence["Batch"]) -> "Batch":
        batches = [b for b in batches if len(b)]
        if not batches:
            return Batch()
        tensors = {}
        for key in batches[0].tensors:
            parts = [b.tensors[key] for b in batches]
            width = max(p.shape[1] for p in parts) if parts[0].dim() > 1 else None
            if width is not None:  # right-pad ragged (B, T) pieces with zeros before stacking
                parts = [torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts]
            tensors[key] = torch.cat(parts)
        meta = {key: [x for b in batches for x in b.meta[key]] for key in batches[0].meta}
        return Batch(tensors, meta)


def _batch_from_wire(tensors: Dict[str, Tuple[np.ndarray, str]], meta: Dict[str, List[Any]]) -> Batch:
    # Copied when read-only, so a worker may modify a Batch it received.
    return Batch({k: from_wire(a if a.flags.writeable else a.copy(), tag) for k, (a, tag) in tensors.items()}, meta)
