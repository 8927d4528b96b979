"""Lock backends: one folder each, each implementing :mod:`celery_dlock.core.protocol`.

A backend never imports another backend, nor :mod:`celery_dlock.task` or
:mod:`celery_dlock.ops` (checked by import-linter).
"""
