"""tito engine service."""
