"""The metadata operations, grouped by what they touch; :class:`kvfs.meta.store.MetaStore` mixes them together.

:mod:`.entries`: names in directories (lookup, create, link, remove, rename, readdir, resolve);
:mod:`.files`: opening and writing regular files; :mod:`.attrs`: attributes and layouts; :mod:`.xattrs`:
extended attributes; :mod:`.delegated`: directory delegations and the changes their holders send. Each class
inherits the groups it builds on; all of them share :class:`.base.OpsBase`.
"""
