"""The Celery face: LockedTask, keys from call arguments, contention policies,
configuration (dlock_* settings), Celery signal hooks and celery-dlock's signals.
"""
