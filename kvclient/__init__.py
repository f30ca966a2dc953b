"""kvclient: the KV-cache library that bypasses FUSE (see README.md in this folder)."""

from .buffers import DeviceSpan, RegisteredBuffer
from .client import AsyncKVClient, BufferTooSmall, ClientClosed, InvalidKey, KVClient, ShortObject
from .gpu import GpuUnavailable

__all__ = ["AsyncKVClient", "BufferTooSmall", "ClientClosed", "DeviceSpan", "GpuUnavailable", "InvalidKey", "KVClient",
           "RegisteredBuffer", "ShortObject"]
