"""Runnable scenarios for celery-dlock; see examples/README.md.

Each ``examples/NAME.py`` runs with one command (``python examples/NAME.py``) on a
throwaway redis-server and real ``celery worker`` processes, and is also a Celery app
module (``celery -A examples.NAME worker``) configured from ``REDIS_URL``.
"""
