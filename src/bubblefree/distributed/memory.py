"""How many bytes a rank's training has held at its peak (``stage_peak_bytes`` in metrics.jsonl).

* CUDA: the caching allocator's ``max_memory_allocated``, every tensor of the process.
* CPU: there is no allocator to ask, so the probe reads the kernel's books: the tensors it knows of when
  training starts (parameters, optimizer state, stashed versions and correction buffers, counted exactly),
  plus how far the resident set grew above its level at that moment (Linux ``VmHWM`` after resetting it
  through ``/proc/self/clear_refs``). The growth is gradients, optimizer state created at the first update,
  update buffers, activations and transients; the C heap may keep freed pages, so it can count a little
  fragmentation too. The kernel's high-water mark is not strictly monotone (pages a heap trim gives back through
  ``madvise`` can lower it, and its counters are cached per thread), so the probe keeps its own running maximum.
  Without ``/proc`` (not Linux) it reports nothing.

The probe starts at the rank's first ``train_step``, when the whole model the rank built has been freed
(only its stage's parameters stay), so the other stages' weights are not counted.
"""

from __future__ import annotations

import gc
from pathlib import Path

import torch

__all__ = ["PeakMemory", "tensor_bytes"]

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_bytes(field: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024  # the kernel writes kB
    raise KeyError(field)


class PeakMemory:
    """Peak bytes since the probe was made (module docstring); ``known`` are the bytes of the tensors alive
    then that the run holds for training (CPU only)."""

    def __init__(self, device: torch.device, known: int):
        self.device, self.known, self.base, self._max = device, known, None, 0
        if device.type == "cuda":
            return
        try:
            gc.collect()
            self.base = _status_bytes("VmRSS")
            _CLEAR_REFS.write_text("5")  # "reset the peak resident set size to the current one" (proc(5))
        except (OSError, KeyError):
            self.base = None

    def peak(self) -> int | None:
        """Bytes at the peak so far, or None where it cannot be measured."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        if self.base is None:
            return None
        self._max = max(self._max, _status_bytes("VmHWM") - self.base)
        return self.known + self._max


def tensor_bytes(*collections) -> int:
    """Bytes of the distinct storages among tensors found in nested dicts, lists and tuples."""
    seen: dict[int, int] = {}

    def visit(x) -> None:
        if isinstance(x, torch.Tensor):
            if x.device.type != "meta":
                storage = x.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
        elif isinstance(x, dict):
            for v in x.values():
                visit(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                visit(v)

    for c in collections:
        visit(c)
    return sum(seen.values())
