"""Redis specifics: the Lua scripts, the lock on one server or one cluster slot,
waiters, key escaping, renewal per server or node, topologies and server checks.
"""
