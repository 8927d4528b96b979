"""SQL backends: a lease row per lock name on the database's own clock.

Each dialect is a package: PostgreSQL through psycopg 3 in :mod:`.postgres`, MySQL
and MariaDB through PyMySQL in :mod:`.mysql`.  What they share is written once in
the modules beside them (the lease logic in :mod:`.lease`, the backend in
:mod:`.lease_backend`, the tables' shape in :mod:`.shape`), which import no driver.
Nothing here is imported by ``import celery_dlock``: each driver is an optional extra
(``celery-dlock[postgres]``, ``celery-dlock[mysql]``), and neither dialect's package
imports the other's driver.
"""
