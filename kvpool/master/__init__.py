"""The master: metadata only (segments, allocations, objects, leases, eviction, liveness).

Pure core, no I/O:  service.py (MasterService: the request surface) over puts.py (the two-
phase put), metadata.py (object records and the table), membership.py (segments, quarantine,
drops), allocator.py (per-segment offsets), placement.py, eviction.py (pluggable policy),
counters.py and codes.py. The asyncio shell is server.py, with metrics.py for HTTP.
"""
