"""Byte units, one definition for every module that prints or parses sizes."""

KIB = 2**10
MIB = 2**20
GIB = 2**30
