"""Reserved for shims of other lock libraries (celery-once, celery-singleton).
"""
