"""Trace replay and simulation on the real master code (DESIGN.md section 9).

trace.py (FAST'25 traces), cluster.py (MasterService with fake segments and a simulated
clock), replay.py (the replay protocol, its accounting and `replay()`), routing.py, belady.py
(the offline optimum as a master eviction policy), reference.py (plain-Python yardsticks),
live.py (the same protocol against real local processes) and report.py (JSON, table, plot).
This package may import anything; nothing in kvpool imports it except the `kvpool replay`
command and the end of `kvpool demo`, which load it lazily.
"""
