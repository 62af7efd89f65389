"""tito render service."""
