from omni_lightning.callbacks.async_d2h import AsyncD2HCallback, PinnedPool

__all__ = ["AsyncD2HCallback", "PinnedPool"]
