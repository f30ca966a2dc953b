"""The parts of the metadata store with state or records of their own, composed by :class:`kvfs.meta.store.MetaStore`.

Each owns its keys in the KV store and the transaction helpers for them: inode ids (:mod:`.ids`), exactly-once
answers (:mod:`.answers`), client leases (:mod:`.leases`), write sessions (:mod:`.sessions`), directory
delegations (:mod:`.delegations`), the chunk collector (:mod:`.gc`) and the change feed's reader (:mod:`.changes`).
The POSIX operations that use them are in :mod:`kvfs.meta.ops`.
"""
