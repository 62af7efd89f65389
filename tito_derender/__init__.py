"""tito derender service."""
