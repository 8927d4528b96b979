"""SQL backends: a lease row per lock name on the database's own clock
(PostgreSQL through psycopg 3 in :mod:`.postgres`).  Nothing here is imported by
``import celery_dlock``: the driver is an optional extra (``celery-dlock[postgres]``).
"""
