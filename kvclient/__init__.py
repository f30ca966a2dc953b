"""kvclient: the KV-cache library that bypasses FUSE (see README.md in this folder)."""

from .buffers import DeviceSpan, RegisteredBuffer
from .client import AsyncKVClient, BufferTooSmall, ClientClosed, InvalidKey, KVClient, ValueTooLarge
from .evict import EvictionPolicy
from .gpu import GpuUnavailable
from .local import ShortObject

__all__ = ["AsyncKVClient", "BufferTooSmall", "ClientClosed", "DeviceSpan", "EvictionPolicy", "GpuUnavailable",
           "InvalidKey", "KVClient", "RegisteredBuffer", "ShortObject", "ValueTooLarge"]
