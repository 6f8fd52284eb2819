"""The registry's store: what must survive every registry and be the same on all of them.

Heartbeats and membership stay in memory (the fast path). The store holds admin intents
(drain, evict/ban, cordon) and the registry replica set:

    url.py      --store URL -> StoreUrl (memory | file:PATH | etcd://HOST:PORT[,...][/PREFIX])
    records.py  keys and values: what is stored, decoded and bounded (pure)
    intents.py  the intents held now, and what each one does to a member (pure)
    base.py     the Store interface every kind implements, and its errors
    memory.py   `memory` (one process, today's behaviour) and `file:PATH` (atomic writes)
    etcd.py     etcd's v3 JSON gateway over httpx; etcd_store.py: load, watch, lease
    sync.py     StoreSync: the store's thread beside the registry loop (applies changes
                through the loop's admin queue; takes admin writes from the HTTP side)
    metrics.py  store up/down, writes, watch events, reloads, lease, refused values

Importing this package imports none of them.
"""
