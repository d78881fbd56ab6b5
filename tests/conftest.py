"""Suite-wide: puts tests/ on sys.path so `tolerance` (shared float bounds) imports anywhere;
keeps measured tables out of the user's cache."""

import os
import tempfile

# measured tables (engine/verify_costs.py) go to a throwaway directory, not the user's cache
os.environ.setdefault("MACFLEET_CACHE", tempfile.mkdtemp(prefix="macfleet-test-cache-"))
