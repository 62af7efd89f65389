"""Tool-call parsers, one module per model family; the registry is in tito_derender.parsers."""
