from omni_lightning.callbacks.async_d2h import AsyncD2HCallback, PinnedPool
from omni_lightning.callbacks.writer import WaveformWriter

__all__ = ["AsyncD2HCallback", "PinnedPool", "WaveformWriter"]
