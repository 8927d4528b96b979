"""For operators: the celery dlock CLI, inspection, metrics, the demo and the
embedded redis-server.
"""
