"""Keel's wire contract: ``keel.proto`` and its generated modules (committed)."""
