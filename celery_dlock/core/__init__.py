"""Backend-neutral: owner tokens, the watchdog and renewal scheduler with its
local deadlines, and the error family. Imports neither redis nor celery.
"""
