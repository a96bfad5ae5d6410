"""Metadata persistence."""

from aenv.store.sqlite import SandboxRow, Store, TemplateRow

__all__ = ["SandboxRow", "Store", "TemplateRow"]
