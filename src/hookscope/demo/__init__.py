"""Built-in demo models and the guided tour that ``hookscope demo`` runs (no downloads)."""
