"""Ray placement and launch of a run's trainer ranks and rollout engines (``launcher: ray``)."""
