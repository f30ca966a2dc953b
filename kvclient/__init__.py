"""kvclient: the KV-cache library that bypasses FUSE (see README.md in this folder)."""

from .client import (
    AsyncKVClient, BufferTooSmall, ClientClosed, InvalidKey, KVClient, RegisteredBuffer, ShortObject, ValueTooLarge,
)
from .evict import EvictionPolicy

__all__ = ["AsyncKVClient", "BufferTooSmall", "ClientClosed", "EvictionPolicy", "InvalidKey", "KVClient",
           "RegisteredBuffer", "ShortObject", "ValueTooLarge"]
