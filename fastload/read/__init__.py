"""fastload.read: a layer package (docstring filled in by the next commit)."""
