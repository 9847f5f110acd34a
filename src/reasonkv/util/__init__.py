"""Small helpers with no reasonkv imports: threads, quiet loading, byte formatting, tables."""
