"""Adapters that other tools load from aenv's source tree, in their own interpreters (Harbor's venv):
they import the E2B SDK and that tool, never aenv's server side, so they work with ``PYTHONPATH=src``
and no aenv dependency installed."""
