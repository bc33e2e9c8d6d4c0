"""CrossbowAccelerator: the device crossbow trains on (CUDA when available, else CPU) and its statistics.

It delegates device handling to Lightning's own CUDA or CPU accelerator and adds what crossbow
needs to read while training: memory used and free on the device (the replica auto-tuner's bound)
and the strategy's measured training throughput, through ``get_device_stats`` (so loggers and
``DeviceStatsMonitor`` see them too). On CUDA it holds each device's pool of streams
(:class:`~lightning_crossbow.streams.StreamPool`) for ``engine="streams"``.
"""

from __future__ import annotations

import gc
from typing import Any, ClassVar, Optional, Union

import torch
from lightning.fabric.accelerators.registry import _AcceleratorRegistry
from lightning.pytorch.accelerators import Accelerator, CPUAccelerator, CUDAAccelerator
from typing_extensions import override

from lightning_crossbow.streams import StreamPool


def _base_class() -> type[Accelerator]:
    return CUDAAccelerator if CUDAAccelerator.is_available() else CPUAccelerator


def device_memory(device: torch.device) -> dict[str, float]:
    """Memory used and free on ``device`` in bytes: CUDA's ``mem_get_info``, or the host's RAM."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return {"memory_used_bytes": float(total - free), "memory_free_bytes": float(free)}
    import psutil

    memory = psutil.virtual_memory()
    return {"memory_used_bytes": float(memory.total - memory.available), "memory_free_bytes": float(memory.available)}


def release_cached_memory(device: torch.device) -> None:
    """After an out-of-memory error: frees what only reference cycles still hold, and on CUDA gives the
    caching allocator's unused blocks back to the device, so that a retry with less finds the memory whole."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class CrossbowAccelerator(Accelerator):
    """Resolves the underlying device type and reports memory and crossbow's samples/s.

    Args:
        device_type: ``"cuda"`` or ``"cpu"``; ``None`` picks CUDA when available, else CPU.

    Lightning reads the devices (``parse_devices``, ``get_parallel_devices``, ``auto_device_count``,
    ``is_available``) from the accelerator's class, not from the instance: ``CrossbowAccelerator("cpu")`` is
    therefore an instance of a subclass whose class answers for the CPU (and ``"cuda"`` for CUDA), so that a
    given device type is kept on a machine that has the other.
    """

    #: The Lightning accelerator whose devices this class reports; None: CUDA when available, else CPU.
    device_accelerator: ClassVar[Optional[type[Accelerator]]] = None

    def __new__(cls, device_type: Optional[str] = None) -> "CrossbowAccelerator":
        if cls is CrossbowAccelerator and isinstance(device_type, str) and device_type in _ON_DEVICE:
            cls = _ON_DEVICE[device_type]
        return super().__new__(cls)

    def __init__(self, device_type: Optional[str] = None) -> None:
        super().__init__()
        own = "cuda" if self._device_class() is CUDAAccelerator else "cpu"  # (a subclass's, or the machine's)
        if device_type is None:
            device_type = own
        if not isinstance(device_type, str) or device_type not in _ON_DEVICE:
            raise ValueError(f"CrossbowAccelerator device_type must be 'cuda' or 'cpu', got {device_type!r}.")
        if self.device_accelerator is not None and device_type != own:
            raise ValueError(f"{type(self).__name__} runs on {own!r}, not {device_type!r}: use CrossbowAccelerator.")
        self.device_type = device_type
        self._base: Accelerator = CUDAAccelerator() if device_type == "cuda" else CPUAccelerator()
        self.samples_per_second: Optional[float] = None  # written by CrossbowStrategy after each step
        self._stream_pools: dict[torch.device, StreamPool] = {}

    @classmethod
    def _device_class(cls) -> type[Accelerator]:
        return cls.device_accelerator or _base_class()

    def stream_pool(self, device: torch.device) -> StreamPool:
        """The CUDA streams of ``device`` for ``engine="streams"``: one pool per device, made on first use."""
        if device not in self._stream_pools:
            self._stream_pools[device] = StreamPool(device)
        return self._stream_pools[device]

    @override
    def setup_device(self, device: torch.device) -> None:
        self._base.setup_device(device)

    @override
    def setup(self, trainer: Any) -> None:
        self._base.setup(trainer)

    @override
    def teardown(self) -> None:
        self._stream_pools.clear()
        self._base.teardown()

    @override
    def get_device_stats(self, device: Union[str, torch.device]) -> dict[str, Any]:
        """Lightning's own statistics of the device, with its memory used and free and crossbow's samples/s."""
        stats = {**self._base.get_device_stats(device), **device_memory(torch.device(device))}
        if self.samples_per_second is not None:
            stats["crossbow/samples_per_sec"] = self.samples_per_second
        return stats

    @classmethod
    @override
    def parse_devices(cls, devices: Any) -> Any:
        return cls._device_class().parse_devices(devices)

    @classmethod
    @override
    def get_parallel_devices(cls, devices: Any) -> list[torch.device]:
        return cls._device_class().get_parallel_devices(devices)

    @classmethod
    @override
    def auto_device_count(cls) -> int:
        return cls._device_class().auto_device_count()

    @classmethod
    @override
    def is_available(cls) -> bool:
        return cls._device_class().is_available()

    @staticmethod
    @override
    def name() -> str:
        return "crossbow"

    @classmethod
    @override
    def register_accelerators(cls, accelerator_registry: _AcceleratorRegistry) -> None:
        accelerator_registry.register(
            "crossbow", cls, description="Crossbow: CUDA when available, else CPU, with crossbow's device stats"
        )


class CrossbowCPUAccelerator(CrossbowAccelerator):
    """``CrossbowAccelerator("cpu")``."""

    device_accelerator = CPUAccelerator


class CrossbowCUDAAccelerator(CrossbowAccelerator):
    """``CrossbowAccelerator("cuda")``."""

    device_accelerator = CUDAAccelerator


_ON_DEVICE: dict[str, type[CrossbowAccelerator]] = {"cpu": CrossbowCPUAccelerator, "cuda": CrossbowCUDAAccelerator}
