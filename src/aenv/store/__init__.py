"""Metadata persistence."""

from aenv.store.sqlite import SandboxRow, SnapshotRow, Store, TemplateRow

__all__ = ["SandboxRow", "SnapshotRow", "Store", "TemplateRow"]
