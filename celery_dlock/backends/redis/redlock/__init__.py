"""Redlock: the Redis lock held on a quorum of independent servers (opt-in)."""
