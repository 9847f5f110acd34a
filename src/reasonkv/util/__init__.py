"""Small helpers with no reasonkv imports: threads, quiet loading, formatting,
tables, JSON records."""
