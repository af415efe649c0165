"""The Keel node agent: registration and lease, rank supervision, the local trainer channel."""
