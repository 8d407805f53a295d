"""pytest plugin: server fixtures (filled in by the backends work)."""
