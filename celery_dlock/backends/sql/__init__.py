"""SQL backends: a lease row per lock name on the database's own clock
(PostgreSQL through psycopg 3 in :mod:`.postgres`, MySQL and MariaDB through PyMySQL
in :mod:`.mysql`; what they share in :mod:`.lease`).  Nothing here is imported by
``import celery_dlock``: each driver is an optional extra (``celery-dlock[postgres]``,
``celery-dlock[mysql]``), and neither dialect's modules import the other's driver.
"""
