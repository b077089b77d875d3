"""Model registry, local checkpoint loading and the built-in tiny model."""
