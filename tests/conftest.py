"""Suite-wide: puts tests/ on sys.path so `tolerance` (shared float bounds) imports anywhere."""
