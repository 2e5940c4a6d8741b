"""Byte units, one definition for every module that prints or parses sizes."""

MIB = 2**20
GIB = 2**30
