"""Rows into results: derived columns, JSON/CSV written atomically, the rich table, the charts."""
