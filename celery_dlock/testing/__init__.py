"""Reserved for fixtures for users' own tests.
"""
