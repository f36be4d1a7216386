"""Shared test settings: hypothesis runs at least 200 examples per property by default."""

from hypothesis import settings

settings.register_profile("echo", max_examples=200, deadline=None)
settings.load_profile("echo")
