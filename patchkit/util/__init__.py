"""Project-agnostic helpers: git over a clone, atomic writes."""
