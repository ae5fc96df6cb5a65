"""Modules that own parameters and call k3.ops."""
