"""Data files of the console (a package so that the wheel ships them)."""
