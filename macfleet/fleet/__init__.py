"""Fleet control plane: discovered agents -> ``FleetSnapshot``; sessions; metrics stream.

``snapshot`` holds the pure data types every observer (the dashboard, recordings) reads.
"""
